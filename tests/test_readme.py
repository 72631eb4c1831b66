"""Every command in the README's code blocks runs as pasted, on this checkout, and exits 0.

The README is parsed, not copied: ``bash`` blocks are run line by line (``\\`` continuations
joined) from the repository root, and the ``python`` block is saved in a temporary folder and
run with the venv's Python from there (the folder a user would use; see the README's note on
shadowing). A block right after a ``<!-- readme-test: skip (reason) -->`` line is not run (the
set-up itself, installs outside the repository, minutes-long benchmarks). A line that starts
``atom serve`` starts the server in the background, waits for ``/health``, leaves it running for
the blocks after it (the README runs the clients "from another terminal") and stops it with
SIGTERM at the end, expecting exit 0. Port 8000 is replaced by a free port.

The README's sizes are for a person watching the output; the test runs each command on the
cheapest settings that still exercise it (the suite's time budget, tests/README.md): the
options in :data:`CHEAPER` are appended to the commands they name (argparse keeps the last
value of an option given twice), and :data:`CHEAPER_PYTHON` edits the ``python`` block. Fewer
prompts and tokens, never another code path; an entry that matches nothing fails the test, so
the tables cannot go stale.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import httpx
import pytest

from atom.engine.spawned_ranks import reserve_port


REPO = pathlib.Path(__file__).resolve().parents[1]
VENV_BIN = pathlib.Path(sys.executable).parent
COMMAND_TIMEOUT_S = 600  # liveness only
_BLOCK = re.compile(r"(?P<skip><!-- readme-test: skip \((?P<why>[^)]*)\) -->\n)?```(?P<lang>\w*)\n"
                    r"(?P<body>.*?)```", re.S)
# appended to every command that starts with the key (README sizes: 16-256 tokens, 8-20 prompts)
CHEAPER = {
    ".venv/bin/atom generate": ["--max-tokens", "4"],
    ".venv/bin/atom bench offline": ["--num-prompts", "2", "--max-tokens", "4"],
    ".venv/bin/atom bench serve": ["--num-prompts", "4", "--random-output-len", "4"],
    ".venv/bin/atom sim sweep": ["--dp-sizes", "2"],
}
CHEAPER_PYTHON = {"max_tokens=64": "max_tokens=8"}


def readme_blocks() -> list[tuple[str, str, str | None]]:
    """(language, body, skip reason or None) of every fenced block, in order."""
    text = (REPO / "README.md").read_text()
    return [(m["lang"], m["body"], m["why"] if m["skip"] else None) for m in _BLOCK.finditer(text)]


def shell_commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank lines dropped."""
    return [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()]


def cheaper(command: str, used: set[str]) -> str:
    """``command`` with the :data:`CHEAPER` options of its prefix appended (its trailing
    ``#`` comment dropped so they are not commented out); the prefix goes into ``used``."""
    for prefix, options in CHEAPER.items():
        if command.startswith(prefix + " "):
            used.add(prefix)
            return shlex.join(shlex.split(command, comments=True) + options)
    return command


def cheaper_python(body: str) -> str:
    for text, replacement in CHEAPER_PYTHON.items():
        assert text in body, f"CHEAPER_PYTHON: {text!r} is no longer in the README's python block"
        body = body.replace(text, replacement)
    return body


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling the server's own readiness, not synchronization by sleep
    raise AssertionError("the server did not become healthy")


def test_readme_parses_into_the_expected_blocks():
    blocks = readme_blocks()
    assert [lang for lang, _, _ in blocks].count("python") == 1
    assert sum(why is None for _, _, why in blocks) >= 4  # most of it runs
    assert all(why for _, _, why in blocks if why is not None)  # every skip says why


@pytest.mark.slow
def test_every_readme_command_runs_as_pasted(tmp_path):
    holder, port = reserve_port()  # held for the test: the servers bind it, nothing else does
    port = str(port)
    servers: list[subprocess.Popen] = []
    used: set[str] = set()
    try:
        for lang, body, skip in readme_blocks():
            if skip is not None:
                continue
            body = body.replace("8000", port)
            if lang == "python":
                script = tmp_path / "readme_example.py"
                script.write_text(cheaper_python(body))
                _run([str(VENV_BIN / "python"), str(script)], cwd=tmp_path)
                continue
            assert lang == "bash", f"a {lang!r} block: run it here or mark it skipped"
            for command in [cheaper(c, used) for c in shell_commands(body)]:
                if command.startswith(".venv/bin/atom serve"):
                    servers.append(subprocess.Popen("exec " + command, shell=True, cwd=REPO,
                                                    stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL))
                    _wait_healthy(servers[-1], f"http://127.0.0.1:{port}")
                else:
                    _run(["bash", "-c", command], cwd=REPO)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        holder.close()
    for server in servers:
        assert server.wait(timeout=120) == 0
    assert used == set(CHEAPER), f"CHEAPER names commands the README lacks: {set(CHEAPER) - used}"


def _run(argv: list[str], *, cwd: pathlib.Path) -> None:
    proc = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S)
    assert proc.returncode == 0, f"{argv[-1]}\nexit {proc.returncode}\n{proc.stderr[-3000:]}"

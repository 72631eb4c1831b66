"""Import layering (docs/ARCHITECTURE.md, "Rules"): launch → dp → atom (engine) → kernels; entrypoints on top.

Checked statically from each module's import statements, so a violation fails here even if no
test happens to import the offending module.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _top(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "atom" and len(parts) > 1 else parts[0]


ENGINE_FORBIDDEN = {"atom.dp", "atom.launch", "atom.entrypoints"}


# atom/__init__.py re-exports the offline LLM (``from atom import LLM``) lazily: the one allowed
# upward reference, since the package root is the public face, not part of the engine.
@pytest.mark.parametrize("path", [p for p in _modules("atom") if "entrypoints" not in p.parts
                                  and (p.name != "__init__.py" or p.parent.name != "atom")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_does_not_import_dp_launch_or_entrypoints(path):
    bad = {n for n in _imports(path) if _top(n) in ENGINE_FORBIDDEN}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the engine never imports dp/launch"


# the bookkeeping (sequence, block manager, scheduler), the wire types and the front end's client
# (so the HTTP layer can validate and send without torch) with its liveness and processes, and
# the rank contract
@pytest.mark.parametrize("name", ["atom/sequence.py", "atom/block_manager.py", "atom/scheduler.py",
                                  "atom/sampling_params.py", "atom/messages.py", "atom/config.py",
                                  "atom/kv_connector.py",
                                  "atom/engine_core_client.py", "atom/liveness.py",
                                  "atom/spawned_ranks.py", "dp/rank_contract.py",
                                  "dp/node_address.py"])
def test_core_bookkeeping_and_wire_types_are_torch_free(name):
    bad = {n for n in _imports(ROOT / name) if n.split(".")[0] == "torch"}
    assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_torch_only(path):
    allowed_roots = set(sys.stdlib_module_names) | {"torch", "__future__", "atom.kernels"}
    bad = {n for n in _imports(path) if n.split(".")[0] not in allowed_roots and _top(n) not in allowed_roots}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("dp"), ids=lambda p: str(p.relative_to(ROOT)))
def test_dp_does_not_import_launch_or_entrypoints(path):
    bad = {n for n in _imports(path) if _top(n) in {"atom.launch", "atom.entrypoints"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("launch"), ids=lambda p: str(p.relative_to(ROOT)))
def test_launch_does_not_import_entrypoints(path):
    bad = {n for n in _imports(path) if _top(n) == "atom.entrypoints"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"

"""Import layering by folder (docs/ARCHITECTURE.md, "The map"; DESIGN.md, "Layout").

Checked statically from each module's import statements (function-level imports included), so a
violation fails here even if no test happens to import the offending module. The rules are per
folder: a new module is covered by where it is put, with no list to update.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from atom.worker import model_loader` names the module atom.worker.model_loader
            names.add(node.module)
    return names


def _modules(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _room(name: str) -> str:
    """The folder an import lands in: 'atom.core', 'atom.dp', ..., 'atom' (the root's public
    and wire types), or the top-level package for anything else ('torch', 'numpy', ...)."""
    parts = name.split(".")
    if parts[0] != "atom":
        return parts[0]
    if len(parts) > 1 and (ROOT / "atom" / parts[1]).is_dir():
        return f"atom.{parts[1]}"
    if len(parts) > 1 and parts[1] in {"dp", "kernels", "launch"}:
        return f"atom.{parts[1]}"
    return "atom"


def _rooms(path: pathlib.Path) -> set[str]:
    return {_room(n) for n in _imports(path)}


def _ids(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT))


ABOVE_THE_ENGINE = {"atom.dp", "atom.launch", "atom.entrypoints", "atom.benchmarks"}

# folder -> the rooms its modules must not import
FORBIDDEN = {
    "atom/core": {"torch", "atom.worker", "atom.engine", "atom.models", "atom.layers"} | ABOVE_THE_ENGINE,
    "atom/worker": {"atom.engine"} | ABOVE_THE_ENGINE,
    "atom/models": {"atom.engine"} | ABOVE_THE_ENGINE,
    "atom/layers": {"atom.engine", "atom.models"} | ABOVE_THE_ENGINE,
    "atom/engine": ABOVE_THE_ENGINE,
    "dp": {"atom.launch", "atom.entrypoints", "atom.benchmarks"},
    "launch": {"atom.entrypoints", "atom.benchmarks"},
}


@pytest.mark.parametrize("path", [p for folder in FORBIDDEN for p in _modules(folder)], ids=_ids)
def test_each_folder_imports_only_what_it_may(path):
    folder = next(f for f in FORBIDDEN if path.is_relative_to(ROOT / f))
    bad = _rooms(path) & FORBIDDEN[folder]
    assert not bad, f"{_ids(path)} imports {sorted(bad)}: {folder}/ may not (docs/ARCHITECTURE.md)"


# The root keeps the public and wire types: torch-free, and below every role folder.
# atom/__init__.py re-exports the offline LLM lazily (``from atom import LLM``): the package
# root is the public face, the one allowed upward reference.
@pytest.mark.parametrize("path", [p for p in (ROOT / "atom").glob("*.py") if p.name != "__init__.py"],
                         ids=_ids)
def test_root_modules_are_torch_free_wire_types(path):
    bad = {r for r in _rooms(path) if r == "torch" or (r.startswith("atom.") and r != "atom")}
    assert not bad, f"{_ids(path)} imports {sorted(bad)}: the root keeps torch-free public types"


# The front end's handle on the cores is imported by the HTTP layer, which validates and sends
# without torch; so are the rank contract and the node address.
@pytest.mark.parametrize("name", ["atom/engine/core_client.py", "atom/engine/liveness.py",
                                  "atom/engine/spawned_ranks.py", "dp/rank_contract.py",
                                  "dp/node_address.py"])
def test_front_end_client_is_torch_free(name):
    assert "torch" not in _rooms(ROOT / name), f"{name} imports torch"


@pytest.mark.parametrize("path", _modules("kernels"), ids=_ids)
def test_kernels_import_torch_only(path):
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__", "atom.kernels"}
    bad = {n for n in _imports(path) if n.split(".")[0] not in allowed and _room(n) not in allowed}
    assert not bad, f"{_ids(path)} imports {sorted(bad)}: kernels import nothing of ours"


def _map_folders() -> list[str]:
    """The folders named in the first column of the map table at the top of ARCHITECTURE.md."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w/]+)/` ", table, flags=re.MULTILINE)


def test_the_architecture_map_matches_the_tree():
    named = _map_folders()
    missing = [f for f in named if not (ROOT / f).is_dir()]
    assert not missing, f"docs/ARCHITECTURE.md's map names folders that do not exist: {missing}"
    packages = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("atom/*/__init__.py")}
    packages |= {"dp", "kernels", "launch"}
    unnamed = sorted(packages - set(named))
    assert not unnamed, f"folders missing from docs/ARCHITECTURE.md's map: {unnamed}"

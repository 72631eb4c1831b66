"""Import layering, read from docs/ARCHITECTURE.md's map (its "may import" column): the map and
this test cannot drift, since the test keeps no table of its own.

Checked statically from each module's import statements (function-level imports included), so a
violation fails here even if no test happens to import the offending module. The rules are per
folder: a new module is covered by where it is put, and must be named in its folder's row.
The front end's torch-freedom is checked transitively: what its modules import when they load,
followed through every module of ours.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE_ROOTS = {"atom": "atom", "atom.dp": "dp", "atom.kernels": "kernels",
                 "atom.launch": "launch"}  # pyproject.toml's package-dir


def _imports(path: pathlib.Path, *, module_level_only: bool = False) -> set[str]:
    """The modules ``path`` imports (``from atom.worker import model_loader`` names the module
    atom.worker.model_loader); with ``module_level_only``, those its top level runs on load
    (not inside a function or ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = _top_level(tree.body) if module_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _top_level(body: list) -> list[ast.stmt]:
    """The statements a module runs when it loads: into if/try/with/class blocks, not into
    functions or ``if TYPE_CHECKING``."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += _top_level(node.orelse)
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                out += _top_level(inner)
    return out


def _module_path(name: str) -> pathlib.Path | None:
    """The file of one of our modules (``atom.dp.sim.rank`` → dp/sim/rank.py), or None."""
    for prefix in sorted(PACKAGE_ROOTS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".").split(".") if name != prefix else []
            base = ROOT / PACKAGE_ROOTS[prefix]
            for candidate in (base.joinpath(*rest).with_suffix(".py") if rest else None,
                              base.joinpath(*rest, "__init__.py")):
                if candidate is not None and candidate.is_file():
                    return candidate
            return None
    return None


def _folder_of(path: pathlib.Path) -> str:
    """The map row a file belongs to: its deepest folder named in the map (``dp/sim/``)."""
    rel = path.relative_to(ROOT).parent.as_posix() + "/"
    return max((f for f in _map() if rel.startswith(f)), key=len)


def _inside(landing: str, folder: str) -> bool:
    """Whether ``landing`` is ``folder`` or below it (the root's subfolders are rooms of their
    own: the root is only itself)."""
    return landing == folder or (folder != "atom/" and landing.startswith(folder))


@functools.cache
def _map() -> dict[str, tuple[str, str]]:
    """folder → (what is there, may import), from the map table of ARCHITECTURE.md."""
    table = ARCHITECTURE.read_text().split("## The map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"`([\w/]+/)`", cells[0]) if len(cells) == 4 else None
        if m:
            rows[m.group(1)] = (cells[1], cells[3])
    return rows


def _rule(folder: str) -> tuple[set[str] | None, bool]:
    """(folders ``folder``'s modules may import besides their own tree, None = all;
    whether torch is forbidden), from its "may import" cell."""
    cell = _map()[folder][1]
    if cell.startswith("all"):
        return None, False
    allowed = set() if cell.startswith("nothing of ours") else set(re.findall(r"`([\w/]+/)`", cell))
    return allowed, "no torch" in cell


def _landing(name: str) -> str | None:
    """The map folder an imported module lives in (``from atom.x import Name``: atom.x's);
    None for one outside atom."""
    if name.split(".")[0] != "atom":
        return None
    path = _module_path(name) or _module_path(name.rpartition(".")[0])
    assert path is not None, f"{name} is no module of ours"
    return _folder_of(path)


def _our_modules() -> list[pathlib.Path]:
    return sorted(p for root in PACKAGE_ROOTS.values() for p in (ROOT / root).rglob("*.py"))


@pytest.mark.parametrize("path", _our_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_imports_what_its_folder_may(path):
    folder = _folder_of(path)
    allowed, no_torch = _rule(folder)
    names = _imports(path)
    if no_torch:
        assert not {n for n in names if n.split(".")[0] == "torch"}, (
            f"{path.relative_to(ROOT)} imports torch: {folder} may not (docs/ARCHITECTURE.md)")
    if allowed is None or path == ROOT / "atom" / "__init__.py":  # the lazy LLM re-export
        return
    if folder == "kernels/":  # torch and the standard library only
        bad = {n for n in names if n.split(".")[0] not in set(sys.stdlib_module_names)
               | {"torch", "__future__"} and _landing(n) != "kernels/"}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: kernels/ may not"
        return
    landings = {n: _landing(n) for n in names}
    bad = {n: f for n, f in landings.items()
           if f is not None and not _inside(f, folder) and f not in allowed}
    assert not bad, (f"{path.relative_to(ROOT)} imports {bad}: {folder} may import only "
                     f"{sorted(allowed) or 'nothing of ours'} (docs/ARCHITECTURE.md's map)")


FRONT_END = ["atom.entrypoints.llm", "atom.entrypoints.cli", "atom.entrypoints.openai.api_server",
             "atom.dp.dp_client", *(f"atom.engine.{p.stem}" for p in (ROOT / "atom" / "engine").glob("*.py"))]


def _loaded_with(name: str) -> dict[str, str]:
    """Every module of ours that loading ``name`` loads (its top-level imports, followed, and
    the packages above each), mapped to the module that imported it first."""
    seen, todo = {name: ""}, [name]
    while todo:
        current = todo.pop()
        path = _module_path(current)
        if path is None:
            continue
        parents = [".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)]
        for imported in [*parents, *_imports(path, module_level_only=True)]:
            if imported not in seen and (_module_path(imported) or imported.startswith("torch")):
                seen[imported] = current
                todo.append(imported)
    return seen


@pytest.mark.parametrize("name", FRONT_END)
def test_the_front_end_loads_no_torch(name):
    loaded = _loaded_with(name)
    torch = sorted(n for n in loaded if n.split(".")[0] == "torch")
    if torch:
        chain, at = [], torch[0]
        while at:
            chain.append(at)
            at = loaded[at]
        pytest.fail(f"loading {name} loads torch: {' <- '.join(chain)}")


def test_the_architecture_map_names_every_folder_and_module():
    named = _map()
    missing = [f for f in named if not (ROOT / f).is_dir()]
    assert not missing, f"docs/ARCHITECTURE.md's map names folders that do not exist: {missing}"
    packages = {p.parent.relative_to(ROOT).as_posix() + "/" for p in ROOT.glob("atom/*/__init__.py")}
    packages |= {"atom/", "dp/", "kernels/", "launch/", "dp/eplb/", "dp/sim/"}
    unnamed = sorted(packages - set(named))
    assert not unnamed, f"folders missing from docs/ARCHITECTURE.md's map: {unnamed}"
    for folder, (what, _) in named.items():
        modules = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        modules |= {p.parent.name for p in (ROOT / folder).glob("*/__init__.py")
                    if p.parent.as_posix() + "/" not in {(ROOT / f).as_posix() + "/" for f in named}}
        modules |= {p.name for p in (ROOT / folder).glob("csrc")}
        found = re.findall(r"`(\w+)(/?)`", what)
        words = {w for w, _ in found}
        names = {w for w, slash in found if not slash and w.lower() == w}  # classes aside
        assert modules <= words, (f"docs/ARCHITECTURE.md's {folder} row does not name "
                                  f"{sorted(modules - words)}")
        assert names <= modules | {"__init__"}, (
            f"docs/ARCHITECTURE.md's {folder} row names modules that do not exist: "
            f"{sorted(names - modules - {'__init__'})}")

"""The package tree keeps its shape: the library apart from the harness, arrows pointing one way.

* ``import turbotrain`` stays light: no DDP machinery, no harness, no optional dependency;
* no library module imports ``turbotrain.bench`` or ``turbotrain.cli`` (bench -> library, never
  back), checked on every import statement, lazy ones in functions included;
* no import cycle among turbotrain's modules: none through module-level imports (as Python runs
  them), and none through imports inside functions either, bar the known ones listed below (an
  import moved into a function hides a cycle from Python, not from the design);
* every module imports.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import turbotrain

SRC = Path(turbotrain.__file__).resolve().parent
#: The harness: it may import the library; the library may not import it.
HARNESS = ("turbotrain.bench", "turbotrain.cli", "turbotrain.tune")
#: What `import turbotrain` may load from comm/: the package (whose __init__ is lazy) and the config
#: dataclass Config needs.
COMM_ALLOWED = {"turbotrain.comm", "turbotrain.comm.config"}
OPTIONAL = ("rich", "matplotlib", "tokenizers", "transformers")
#: (importer, imported package) edges through a function-level import that close a cycle today;
#: each is a reported issue, to be removed here when fixed.
KNOWN_LAZY_CYCLES: set = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _targets(node, module: str) -> list[str]:
    """The turbotrain modules an import statement loads (``from X import name``: X.name if that is a
    module, else X)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "turbotrain"]
    if node.level:
        base = _package_of(module).split(".")
        base = base[: len(base) - node.level + 1]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    if origin.split(".")[0] != "turbotrain":
        return []
    return [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]


def _is_type_checking(node) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, *, module_level: bool) -> set[str]:
    """Every turbotrain module ``module`` imports; ``module_level`` leaves out function bodies and
    ``if TYPE_CHECKING:`` blocks (what runs when the module is imported)."""
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_targets(node, module))
            elif module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif module_level and isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
            else:
                visit(ast.iter_child_nodes(node))

    visit(ast.parse(MODULES[module].read_text()).body)
    return found


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph(module_level: bool = True) -> dict[str, set[str]]:
    """module -> modules its import runs. Importing a.b.c runs a and a.b first, so those count too,
    except the importer's own packages: they are already being imported when it runs."""
    graph = {}
    for module in MODULES:
        own = {module, *_ancestors(module)}
        edges = set()
        for target in _imports(module, module_level=module_level):
            edges.update(t for t in (target, *_ancestors(target)) if t in MODULES and t not in own)
        graph[module] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def dfs(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_import_turbotrain_stays_light():
    code = "import json, sys, turbotrain; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(proc.stdout))
    comm = {m for m in loaded if m.startswith("turbotrain.comm")}
    assert comm <= COMM_ALLOWED, f"`import turbotrain` loads {sorted(comm - COMM_ALLOWED)}"
    harness = sorted(m for m in loaded if m.startswith(HARNESS))
    assert not harness, f"`import turbotrain` loads the harness: {harness}"
    optional = sorted(m for m in OPTIONAL if m in loaded)
    assert not optional, f"`import turbotrain` loads optional dependencies: {optional}"


def test_the_library_never_imports_the_harness():
    offenders = []
    for module in MODULES:
        if module.startswith(HARNESS):
            continue
        for target in _imports(module, module_level=False):
            if target.startswith(HARNESS):
                offenders.append(f"{module} imports {target}")
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_through_lazy_imports_either():
    graph = _graph(module_level=False)
    for importer, package in KNOWN_LAZY_CYCLES:
        graph[importer] = {t for t in graph.get(importer, ()) if not (t == package or t.startswith(package + "."))}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (through a function-level import): " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_imports_resolve_to_modules():
    imports = _imports("turbotrain.bench.runner", module_level=True)
    assert {"turbotrain.bench.configs", "turbotrain.hardware", "turbotrain.utils"} <= imports


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports(module):
    importlib.import_module(module)


# ----------------------------------------------------------------------------- optional dependencies
@pytest.mark.parametrize("blocked, call, extra", [
    ("rich.console", lambda: importlib.import_module("turbotrain.bench.console").make_console(), "bench"),
    ("matplotlib", lambda: importlib.import_module("turbotrain.bench.report").write_charts({}, Path(".")), "bench"),
    ("tokenizers", lambda: importlib.import_module("turbotrain.workloads.data").load_corpus(), "text"),
    ("numpy", lambda: importlib.import_module("turbotrain.workloads.data").load_corpus(), "text"),
])
def test_a_missing_optional_dependency_names_its_extra(blocked, call, extra, monkeypatch):
    from turbotrain.errors import HardwareError

    monkeypatch.setitem(sys.modules, blocked, None)  # `import blocked` now raises ImportError
    with pytest.raises(HardwareError, match=rf"pip install 'turbotrain\[{extra}\]'"):
        call()

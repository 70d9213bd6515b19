"""The packages' import graph (parsed with `ast`, nothing imported): a DAG, layered (tests, scripts) -> rl ->
(jaxllm, render), and no package imports scripts/ or tests/ (library code lives in the packages).

Every import counts, also those inside functions (a lazy import still ties two modules together).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxllm", "render", "rl")
CALLERS = ("scripts", "tests")  # import the packages; never imported by them
# package -> packages (ours or third-party roots) it must never import
FORBIDDEN = {"render": {"jaxllm", "rl", *CALLERS}, "jaxllm": {"craftax", "render", "rl", *CALLERS}, "rl": {*CALLERS}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The modules `path` imports: ours by full name (`from a import b` is a.b when that is a module of ours,
    else a; relative imports resolved), third-party ones by their top-level name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {name if name in modules else name.split(".")[0] for name in found} - {module}


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module of PACKAGES and CALLERS."""
    files = {_module_name(p): p for pkg in PACKAGES + CALLERS for p in (ROOT / pkg).rglob("*.py")}
    return {module: _imports(path, module, set(files)) for module, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among our modules, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_is_a_dag():
    graph = _graph()
    assert {"rl.trainer", "rl.sharding", "jaxllm.model", "render.template", "scripts.parity_report",
            "tests.parity.conftest"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers(package):
    graph = _graph()
    bad = sorted((m, d) for m, deps in graph.items() if m.split(".")[0] == package
                 for d in deps if d.split(".")[0] in FORBIDDEN[package])
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


def test_the_layer_check_sees_an_import_of_tests(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from tests.parity import conftest\n")
    assert "tests" in _imports(bad, "rl.m", set())


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "x"}, "b": set()}) is None


# The tools (issue 34): each imports the shared layers below it, never another tool. A tool is its entry module
# and the modules only it uses; rl.video is the recorder layer under `rl.eval --video`, rl.offline's config, data,
# networks, update and policy are the offline layers that rl.offline and rl.probe share.
TOOLS = {"train": {"rl.train"}, "eval": {"rl.eval"}, "label": {"rl.label"}, "plot": {"rl.plot"},
         "offline": {"rl.offline.__main__", "rl.offline.train", "rl.offline.evaluate"},
         "probe": {"rl.probe.__main__", "rl.probe.core", "rl.probe.forward", "rl.probe.states", "rl.probe.policy",
                   "rl.probe.parts"}}
MAX_FLOORS = 8  # rl's import layers (longest chain of rl modules, each on top of what it imports); 12 before issue 34,
# 9 before rl.video took a restored policy instead of restoring it


def _tool_of(module: str) -> str | None:
    return next((tool for tool, modules in TOOLS.items() if module in modules), None)


def test_no_tool_imports_another_tool():
    graph = _graph()
    assert set().union(*TOOLS.values()) <= set(graph)
    bad = sorted((m, d) for m, deps in graph.items() for d in deps
                 if _tool_of(m) and _tool_of(d) and _tool_of(m) != _tool_of(d))
    assert not bad, f"a tool imports another tool (move what they share into a layer below both): {bad}"


def rl_floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """module -> its floor: 1 + the highest floor among the rl modules it imports (1 for none)."""
    rl = {m: {d for d in deps if d in graph and d.split(".")[0] == "rl"} for m, deps in graph.items()
          if m.split(".")[0] == "rl"}
    floors: dict[str, int] = {}

    def floor(m):
        if m not in floors:
            floors[m] = 1 + max((floor(d) for d in rl[m]), default=0)
        return floors[m]

    for m in rl:
        floor(m)
    return floors


def test_rl_stands_on_few_floors():
    floors = rl_floors(_graph())
    top = max(floors.values())
    assert top <= MAX_FLOORS, f"rl now stands on {top} floors (at most {MAX_FLOORS}): " + ", ".join(
        sorted(m for m, f in floors.items() if f == top))

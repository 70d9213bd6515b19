"""The compile rule (issues 34, 35): every program that runs the LLM, and the offline update, compiles through
`jaxllm.compile.jit` (in rl: `rl.llm.compile_llm` / `compile_program`), never a plain `jax.jit`.

An AST walk over rl/ and scripts/ (nothing imported): at every plain `jax.jit` (a call, `@jax.jit`, or
`partial(jax.jit, ...)`), the names the jitted code reaches are collected, following the functions and
assignments of the same module by name; any name that runs the LLM or the offline update fails the test. A new
tool that writes `jax.jit(lambda ...: encode(...))` or jits a function calling `llm.encode_ids` cannot forget.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIRS = ("rl", "scripts")
# names whose use means "this code runs the LLM" (jaxllm's entry points and rl's encode functions) or the offline
# AWR update
LLM_NAMES = {"prefill", "encode", "encode_ids", "encode_packed", "encode_bucketed", "encode_states", "hidden_states",
             "label_observations", "make_ids_encoder", "make_inscan_encoder", "make_llm_encoder",
             "make_obs_encoder", "awr_loss", "make_train_chunk", "batch_inputs"}


def _is_jax_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "jit" and isinstance(node.value, ast.Name) \
        and node.value.id == "jax"


def _is_partial_of_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "partial" \
        and bool(node.args) and _is_jax_jit(node.args[0])


def plain_jit_sites(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, the jitted code) of every plain jax.jit in a module."""
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_jax_jit(node.func) and node.args:
            sites.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and _is_partial_of_jit(node.func) \
                and node.args:
            sites.append((node.lineno, node.args[0]))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(_is_jax_jit(d) or _is_partial_of_jit(d) for d in node.decorator_list):
                sites.append((node.lineno, node))
    return sites


FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _scope_definitions(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """name -> the functions defined and values assigned directly in `scope` (a module or a function), not
    inside the functions nested in it (their locals are theirs)."""
    defs: dict[str, list[ast.AST]] = {}
    todo = list(scope.body) if not isinstance(scope, ast.Lambda) else []
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.setdefault(node.name, []).append(node)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defs.setdefault(name.id, []).append(node.value)
        todo.extend(ast.iter_child_nodes(node))
    return defs


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def reached_names(code: ast.AST, tree: ast.AST, parents: dict[int, ast.AST]) -> set[str]:
    """Every name and attribute `code` uses, following the definitions (in `code`'s own and its enclosing
    scopes) of the names it uses."""
    seen: set[str] = set()
    todo = [code]
    visited: set[int] = set()
    while todo:
        node = todo.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        scopes, up = [], node
        while up is not None:
            if isinstance(up, FUNCS) or up is tree:
                scopes.append(up)
            up = parents.get(id(up))
        defs: dict[str, list[ast.AST]] = {}
        for scope in scopes:
            for name, values in _scope_definitions(scope).items():
                defs.setdefault(name, []).extend(values)
        for sub in ast.walk(node):
            name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
            if name is None:
                continue
            seen.add(name)
            if isinstance(sub, ast.Name):
                todo.extend(v for v in defs.get(name, ()) if v is not node)
    return seen


def violations(source: str, filename: str = "<string>") -> list[str]:
    tree = ast.parse(source, filename)
    parents = _parents(tree)
    out = []
    for line, code in plain_jit_sites(tree):
        hits = sorted(reached_names(code, tree, parents) & LLM_NAMES)
        if hits:
            out.append(f"{filename}:{line}: plain jax.jit reaches {', '.join(hits)}; compile it with "
                       f"rl.llm.compile_llm or compile_program (jaxllm.compile.jit)")
    return out


def test_no_plain_jit_reaches_the_llm_or_the_offline_update():
    found = []
    for d in DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            found += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_rule_sees_each_way_of_jitting():
    direct = "import jax\nfrom jaxllm import prefill\ncache = jax.jit(prefill, static_argnums=1)(p, c, ids)\n"
    decorated = ("import jax\n\ndef make(llm):\n    @jax.jit\n    def f(args, ids, n):\n"
                 "        return llm.encode_ids(*args, ids, n)\n    return f\n")
    through_a_helper = ("import jax\nfrom functools import partial\n\ndef helper(x):\n    return encode(x)\n\n"
                        "@partial(jax.jit, static_argnames='k')\ndef f(x, k):\n    return helper(x)\n")
    via_assignment = "import jax\nrun = make_train_chunk(net)\nstep = jax.jit(lambda s: run(s))\n"
    for source in (direct, decorated, through_a_helper, via_assignment):
        assert violations(source), source
    fine = "import jax\nreset = jax.jit(lambda k: env.reset(k))\n"
    assert not violations(fine)
    good = "from rl.llm import compile_llm\nf = compile_llm(lambda a, ids, n: encode_ids(*a, ids, n))\n"
    assert not violations(good)


def test_no_jax_jit_of_prefill_outside_jaxllm():
    found = [f"{p.relative_to(ROOT)}" for d in DIRS for p in (ROOT / d).rglob("*.py")
             if "jax.jit(prefill" in p.read_text()]
    assert not found, found

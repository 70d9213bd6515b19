"""render: refusals (unsafe piece boundaries, wrong env, bad arguments) and system prompt handling."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxllm import load_tokenizer
from render import UnsafeBoundaryError, build_template, render_text
from render.envs import CLASSIC, CRAFTAX
from render.layout import Choice, Const, Format, Layout, Number, Section
from render.template import check_boundaries, compile_template


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _format(*sections) -> Format:
    return Format("test", "test", Layout(tuple(sections)), values=lambda s: {})


@pytest.mark.parametrize(
    "columns, bad",
    [
        # ": " + a word: the space belongs to the word's token (" wood").
        ((Const("Wood: "), Choice(("tree", "stone"))), "tree"),
        # ":" + "\n" is one token.
        ((Const("Inventory:"), Const("\nWood")), "\nWood"),
        # two newlines merge.
        ((Const("a line\n"), Choice(("", "\nnext"))), "\nnext"),
        # a word cut in the middle: "Health" + "y" is one pre-token.
        ((Number(2, label=" food="), Const("\nHealth"), Choice(("y", "ier"))), "y"),
        # after an optional (possibly empty) piece, the previous piece meets the next one.
        ((Const("Status:"), Choice(("", " sleeping")), Const("\n")), "\n"),
    ],
)
def test_compiler_refuses_unsafe_boundary(tokenizer, columns, bad):
    fmt = _format(Section("line", columns))
    with pytest.raises(UnsafeBoundaryError, match=r"unsafe token boundary between line\[column \d+\]") as err:
        compile_template(tokenizer, fmt, "You play.", "test")
    assert repr(bad)[:20] in str(err.value)


def test_compiler_accepts_safe_boundaries_and_knows_never_empty_rows(tokenizer):
    head = "<|im_start|>user\n"
    ok = Layout((
        Section("a", (Const("Map:\n"),)),
        Section("rows", (Choice(("0, 1:", "-1, 0:")), Choice((" tree", " water")), Const("\n")), rows=3,
                optional_rows=True),
        Section("label", (Const("Inventory:"),)),
        Section("items", (Number(3, optional=True, label=" wood="), Choice(("", " nothing"))), never_empty=True),
        Section("end", (Const("\nHealth: "), Number(2, 1), Const("\n"))),
    ))
    assert check_boundaries(tokenizer, ok, head) > 10
    # Without never_empty the row may vanish, so "Inventory:" + "\nHealth" (":\n" merges) is refused.
    bad = Layout(ok.sections[:3] + (Section("items", ok.sections[3].columns),) + ok.sections[4:])
    with pytest.raises(UnsafeBoundaryError, match="label"):
        check_boundaries(tokenizer, bad, head)


def test_wrong_env_state_is_refused(tokenizer):
    from craftax.craftax_classic.envs.craftax_symbolic_env import CraftaxClassicSymbolicEnvNoAutoReset

    env = CraftaxClassicSymbolicEnvNoAutoReset()
    _, state = env.reset(jax.random.PRNGKey(0), env.default_params)
    tpl = build_template(tokenizer, CRAFTAX, "compact")
    with pytest.raises(TypeError, match=r"render for 'Craftax-Symbolic-v1' needs a craftax\.craftax\.craftax_state\.EnvState"):
        tpl(state)
    with pytest.raises(TypeError, match="unwrap"):
        tpl.text(state)
    with pytest.raises(TypeError, match="Craftax-Symbolic-v1"):
        render_text(state, CRAFTAX)
    with pytest.raises(TypeError, match="got builtins.dict"):
        render_text({"map": jnp.zeros(3)}, CLASSIC)
    # The right env works on the same state.
    assert render_text(state, CLASSIC).startswith("Map:\n")


def test_batched_state_to_template_call_is_refused(tokenizer):
    from render.sample_states import sample_states  # noqa: F401 (cheap import check)
    from craftax.craftax_classic.envs.craftax_symbolic_env import CraftaxClassicSymbolicEnvNoAutoReset

    env = CraftaxClassicSymbolicEnvNoAutoReset()
    _, states = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(jax.random.PRNGKey(0), 2), env.default_params)
    tpl = build_template(tokenizer, CLASSIC, "compact")
    with pytest.raises(ValueError, match="jax.vmap"):
        tpl(states)
    assert len(tpl.text(states)) == 2 and len(render_text(states, CLASSIC)) == 2


def test_bad_names_are_refused(tokenizer):
    with pytest.raises(ValueError, match="unknown env 'Craftax-Pixels-v1'.*Craftax-Symbolic-v1"):
        build_template(tokenizer, "Craftax-Pixels-v1")
    with pytest.raises(ValueError, match="unknown format 'short'.*compact"):
        build_template(tokenizer, CLASSIC, fmt="short")
    with pytest.raises(TypeError, match="system_prompt must be"):
        build_template(tokenizer, CLASSIC, system_prompt=42)
    with pytest.raises(ValueError, match="assembly must be one of 'auto', 'jnp', 'pallas', got 'triton'"):
        build_template(tokenizer, CLASSIC, assembly="triton")


def test_system_prompt_string_and_file(tokenizer, tmp_path):
    text = "You are a careful Craftax player.\nAnswer with one action."
    path = tmp_path / "prompt.txt"
    path.write_text(text)
    from_string = build_template(tokenizer, CLASSIC, system_prompt=text)
    from_file = build_template(tokenizer, CLASSIC, system_prompt=str(path))
    from_pathlib = build_template(tokenizer, CLASSIC, system_prompt=path)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": text}, {"role": "user", "content": "X"}],
        tokenize=True, add_generation_prompt=True, enable_thinking=False,
    )
    expected = list(expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected)
    head = expected[: expected.index(tokenizer.convert_tokens_to_ids("X"))]
    assert from_string.prefix_ids == from_file.prefix_ids == from_pathlib.prefix_ids == head
    default = build_template(tokenizer, CLASSIC)
    assert default.prefix_ids != head and "Craftax-Classic" in default.head
    with pytest.raises(FileNotFoundError):
        build_template(tokenizer, CLASSIC, system_prompt=tmp_path / "missing.txt")


@pytest.mark.parametrize("kwargs", [dict(rows=3, max_rows_shown=2), dict(rows=3, optional_rows=True, max_rows_shown=4),
                                    dict(rows=3, optional_rows=True, max_rows_shown=0)])
def test_section_refuses_a_bad_row_cap(kwargs):
    with pytest.raises(ValueError, match="max_rows_shown"):
        Section("map", (Const("x\n"),), **kwargs)


def test_sample_states_under_an_outer_jit_leaks_no_tracer():
    """`sample_states` with a traced seed (the suite compiles the sampler so, at full optimisation) as the first
    use of craftax in a process: craftax's env modules, imported then, must keep concrete constants, not the
    outer trace's tracers (they broke every later call with UnexpectedTracerError). A fresh process: this one
    has craftax imported already. Tracing only (nothing compiles)."""
    code = (
        "import jax\n"
        "from render.sample_states import sample_states\n"
        "with jax.checking_leaks():\n"
        "    jax.make_jaxpr(lambda seed: sample_states('Craftax-Classic-Symbolic-v1', 2, seed, steps=1))(3)\n"
        "print('no leak')\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "no leak" in proc.stdout, proc.stderr[-3000:]

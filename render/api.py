"""The two entry points: `build_template` and `render_text`."""
from __future__ import annotations

from pathlib import Path
from typing import Union

from render.chat import resolve_system_prompt
from render.envs import get_format
from render.sources import check_input, input_is_batched
from render.template import PAD_ID, Template, compile_template, format_values_numpy
from render.text import texts_from_values


def build_template(
    tokenizer,
    env_name: str,
    fmt: str = "compact",
    system_prompt: Union[str, Path, None] = None,
    assembly: str = "auto",
    source: str = "state",
) -> Template:
    """Compile the prompt template of `env_name` in format `fmt` ("compact" or "full").

    system_prompt: None for our default prompt of that env and format, else the prompt text or a
    path to a file holding it. Raises UnsafeBoundaryError if a piece boundary is not token-safe.
    assembly: how column values become ids: "auto" (default: the one-kernel Pallas assembly on a CUDA GPU, XLA
    ops elsewhere), "jnp" (XLA ops everywhere) or "pallas" (the kernel everywhere; interpreted off CUDA, slow).
    All three give the same ids.
    source: what the template reads: "state" (a raw craftax EnvState, default) or "obs" (the env's symbolic
    observation vector, float [O]: `tpl(obs)`, `tpl.text(obs)`); docs/RENDER.md lists the few facts an
    observation shows differently.
    """
    format_ = get_format(env_name, fmt)
    system = resolve_system_prompt(system_prompt, env_name, fmt)
    return compile_template(tokenizer, format_, system, env_name, pad_id=PAD_ID, assembly=assembly, source=source)


def render_text(state, env_name: str, fmt: str = "compact", source: str = "state"):
    """The observation text of a raw craftax state or, with `source="obs"`, of a symbolic observation vector
    (a string), or of a batch of either (a list)."""
    check_input(state, env_name, source)
    format_ = get_format(env_name, fmt)
    batched = input_is_batched(state, source)
    texts = texts_from_values(format_.layout, format_values_numpy(format_, state, batched, source))
    return texts if batched else texts[0]

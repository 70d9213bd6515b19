"""Prompt-only edits: the policy sees the base state's observation, the LLM reads another text.

A prompt-only pair keeps the symbolic observation of the low state for both sides and changes only the token
ids given to the LLM: either the ids of the edited (high) state of a state kind (`prompt:<kind>`), or the low
state's own text with a sentence injected before the chat tail (`INJECTIONS`: "an enemy is adjacent" where none
is, nonsense). With zero/noise hidden states both sides read the same vector, so those modes give 0 there.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

PREFIX = "prompt:"
MAX_INJECTED = 32  # tokens an injected sentence may take (every injected prompt is padded to one width)


@dataclass(frozen=True)
class Injection:
    """A sentence appended to the observation text (before the chat tail); `applies(state)` -> bool."""

    name: str
    text: str
    expected_sign: int  # sign V(with text) - V(without) should have
    needs_no_adjacent_zombie: bool = False


INJECTIONS = (
    Injection("enemy_adjacent_text", "Warning: a zombie is adjacent to you and attacking.\n", -1, True),
    # nonsense carries no information: any change is the policy reading noise; -1 reads "should not raise V"
    Injection("nonsense_text", "Purple elephants sing quietly beneath the marmalade ocean.\n", -1),
)
INJECTION_NAMES = tuple(PREFIX + i.name for i in INJECTIONS)


def injection(name: str) -> Injection:
    for i in INJECTIONS:
        if PREFIX + i.name == name:
            return i
    raise ValueError(f"unknown injection {name!r}")


def tail_length(template, tokenizer) -> int:
    """Tokens of the chat tail that closes every prompt of `template` (its ids end with them)."""
    return len(tokenizer([template.tail], add_special_tokens=False)["input_ids"][0])


def inject_ids(ids: jax.Array, length: jax.Array, extra: np.ndarray, tail: int, pad_id: int):
    """ONE prompt's ids [T] (length `length`, ending with `tail` chat-tail tokens) with `extra` ids inserted
    before the tail -> (ids [T + len(extra)], length + len(extra)). Pure jnp."""
    k = len(extra)
    cut = length - tail
    i = jnp.arange(ids.shape[0] + k)
    padded = jnp.concatenate([ids, jnp.full((k,), pad_id, ids.dtype)])
    shifted = padded[jnp.clip(i - k, 0, ids.shape[0] + k - 1)]
    inserted = jnp.asarray(extra, ids.dtype)[jnp.clip(i - cut, 0, k - 1)]
    out = jnp.where(i < cut, padded, jnp.where(i < cut + k, inserted, shifted))
    out = jnp.where(i < length + k, out, pad_id)
    return out, length + k


def zombie_adjacent(env_name: str, state) -> jax.Array:
    """True where a live zombie stands next to the player (4-neighbourhood), on the player's floor."""
    from render.envs import CLASSIC

    if env_name == CLASSIC:
        pos, mask = state.zombies.position, state.zombies.mask
    else:
        lvl = state.player_level
        mobs = state.melee_mobs
        pos, mask = mobs.position[lvl], mobs.mask[lvl] & (mobs.type_id[lvl] == 0)
    dist = jnp.abs(pos - state.player_position[None, :]).sum(-1)
    return jnp.any(mask & (dist == 1))

"""THE table of hidden-state ablation modes: one name and one meaning in every tool (rl.eval, rl.video,
rl.offline eval, rl.probe).

A mode says which vector a policy that reads an LLM hidden state gets in place of the real one, on the same
worlds and seeds. "Zero" is defined at the policy's input, after its own normalisation: an online policy
(`ActorCriticAug`) normalises raw vectors itself and reads raw zeros; an offline policy z-scores its input with
its dataset's statistics, so its zero is the dataset's mean hidden state (z-scored: exactly zero). Both say "the
policy sees no information from the LLM, at the centre of what it saw in training".
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Mode:
    name: str
    meaning: str
    needs_llm: bool = True  # False: the vector does not come from the LLM at all
    batch_dependent: bool = False  # True: a row's vector depends on the other rows of the batch


MODE_TABLE = (
    Mode("real", "the hidden states the policy was trained with (refreshed every skip_n steps)"),
    Mode("zero", "the policy's zero: raw zero vectors for an online policy, the dataset's mean hidden state "
                 "(z-scored: zero) for an offline one", needs_llm=False),
    Mode("noise", "Gaussian noise with the per-feature mean and std of the real vectors of the same batch",
         batch_dependent=True),
    Mode("shuffled", "real vectors, but of another env's state (rolled by one over the batch)", batch_dependent=True),
    Mode("other_prompt", "the real model on the same game text, behind another system prompt (OTHER_PROMPT)"),
)
MODES = tuple(m.name for m in MODE_TABLE)
MEANINGS = {m.name: m.meaning for m in MODE_TABLE}
OTHER_PROMPT = "You are a helpful assistant. Describe what you see."


def describe(names=MODES) -> str:
    """One line per mode: `name  meaning` (for docstrings and --help)."""
    width = max(len(n) for n in names)
    return "\n".join(f"    {n:<{width}}  {MEANINGS[n]}" for n in names)


def check_modes(modes, *, uses_hidden: bool, flag: str = "--modes") -> tuple[str, ...]:
    """`modes` as a tuple, or ValueError (one line) naming an unknown mode, or a mode a policy without a hidden
    state cannot play."""
    modes = tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"{flag} {' '.join(bad)}: not one of {', '.join(MODES)}")
    if not uses_hidden and modes != ("real",):
        raise ValueError(f"this policy reads no hidden state: only {flag} real applies")
    return modes


def shuffled(h: jax.Array) -> jax.Array:
    """Every row gets the next row's vector (rolled by one over the batch)."""
    return jnp.roll(h, 1, axis=0)


def noise(h: jax.Array, key: jax.Array) -> jax.Array:
    """Gaussian draws with the per-feature mean and std of the rows of `h`."""
    return h.mean(0, keepdims=True) + h.std(0, keepdims=True) * jax.random.normal(key, h.shape, h.dtype)


def ablate(h: jax.Array, mode: jax.Array, key: jax.Array, zero: jax.Array | None = None,
           other: jax.Array | None = None) -> jax.Array:
    """Hidden states [B, D] for ablation `mode` (traced int: index into MODES) of the real ones `h`. `zero`: the
    policy's zero vector [D] (None: raw zeros); `other`: the vectors behind OTHER_PROMPT (None: `h`, for a caller
    that computes other_prompt's play with another prefix cache as `h`)."""
    z = jnp.zeros_like(h) if zero is None else jnp.broadcast_to(zero, h.shape).astype(h.dtype)
    options = jnp.stack([h, z, noise(h, key), shuffled(h), h if other is None else other])
    return options[mode]

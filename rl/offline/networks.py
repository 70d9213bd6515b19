"""The offline AWR actor and critic (the reference pipeline's shapes): separate towers, tanh, orthogonal init.

Augmented: obs -> Dense tanh and hidden -> Dense tanh, concatenated, -> Dense tanh -> Dense tanh -> head.
Unaugmented (`hidden` None): obs -> 3 x Dense tanh -> head. Orthogonal init sqrt(2), actor head 0.01, critic
head 1.0, zero biases. The hidden input is expected already z-scored (`normalise`).
"""
from __future__ import annotations

import distrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _dense(width: int, scale: float) -> nn.Dense:
    return nn.Dense(width, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


class Tower(nn.Module):
    """One tower: (obs [B, O], hidden [B, D] | None) -> [B, out]."""

    out: int
    head_scale: float
    width: int = 512

    @nn.compact
    def __call__(self, obs: jax.Array, hidden: jax.Array | None) -> jax.Array:
        act = lambda x: nn.tanh(_dense(self.width, np.sqrt(2))(x))
        if hidden is None:
            x = act(act(act(obs)))
        else:
            x = jnp.concatenate([act(obs), act(hidden)], axis=-1)
            x = act(act(x))
        return _dense(self.out, self.head_scale)(x)


class AWRNetwork(nn.Module):
    """(obs, hidden | None) -> (distrax.Categorical, value [B])."""

    num_actions: int
    width: int = 512

    @nn.compact
    def __call__(self, obs: jax.Array, hidden: jax.Array | None = None):
        obs = obs.astype(jnp.float32)
        hidden = None if hidden is None else hidden.astype(jnp.float32)
        logits = Tower(self.num_actions, 0.01, self.width, name="actor")(obs, hidden)
        value = Tower(1, 1.0, self.width, name="critic")(obs, hidden)
        return distrax.Categorical(logits=logits), value[:, 0]


def normalise(hidden: jax.Array, stats: dict) -> jax.Array:
    """z-score raw hidden states [B, D] with the dataset statistics {"mean", "std"} (float32)."""
    return (hidden.astype(jnp.float32) - stats["mean"]) / stats["std"]

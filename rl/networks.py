"""Policy/value networks: the reference `ActorCritic` and `ActorCriticAug` (obs + LLM hidden state).

Both return `(distrax.Categorical, value [B])`. Initialisation follows the reference trainer:
orthogonal weights (sqrt(2) for hidden layers, 0.01 for the actor head, 1.0 for the critic head),
zero biases, tanh activations, width 512.
"""
from __future__ import annotations

from typing import Sequence

import distrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

FUSIONS = ("norm", "raw")


def _dense(width: int, scale: float) -> nn.Dense:
    return nn.Dense(width, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


def _mlp(x: jax.Array, widths: Sequence[int]) -> jax.Array:
    for w in widths:
        x = nn.tanh(_dense(w, np.sqrt(2))(x))
    return x


class ActorCritic(nn.Module):
    """Reference network: separate actor and critic MLPs (3 x Dense+tanh each) on the observation."""

    num_actions: int
    width: int = 512

    @nn.compact
    def __call__(self, obs: jax.Array, hidden: jax.Array | None = None):
        del hidden  # plain PPO has no LLM input
        actor = _mlp(obs, [self.width] * 3)
        logits = _dense(self.num_actions, 0.01)(actor)
        critic = _mlp(obs, [self.width] * 3)
        value = _dense(1, 1.0)(critic)
        return distrax.Categorical(logits=logits), jnp.squeeze(value, -1)


class ActorCriticAug(nn.Module):
    """Network reading the observation and an LLM hidden state (the reference's augmented policy).

    A shared trunk (3 x Dense+tanh) encodes the observation; the hidden state joins it by
    concatenation; then an actor head (Dense+tanh -> logits) and a critic head (2 x Dense+tanh -> 1).
    `fusion="norm"` (default) standardises each hidden-state vector first (zero mean, unit variance
    over its features, no learned scale), so Qwen's large residual-stream outliers cannot swamp the
    observation features; `fusion="raw"` concatenates the raw vector, as the reference did.
    """

    num_actions: int
    width: int = 512
    fusion: str = "norm"

    @nn.compact
    def __call__(self, obs: jax.Array, hidden: jax.Array):
        if self.fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {self.fusion!r}; choose one of {FUSIONS}")
        trunk = _mlp(obs, [self.width] * 3)
        hidden = hidden.astype(jnp.float32)
        if self.fusion == "norm":
            hidden = nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6)(hidden)
        x = jnp.concatenate([trunk, hidden], axis=-1)
        logits = _dense(self.num_actions, 0.01)(_mlp(x, [self.width]))
        value = _dense(1, 1.0)(_mlp(x, [self.width] * 2))
        return distrax.Categorical(logits=logits), jnp.squeeze(value, -1)


def make_network(num_actions: int, *, augmented: bool, fusion: str = "norm", width: int = 512) -> nn.Module:
    """The trainer's network: `ActorCriticAug` when an LLM hidden state is used, else `ActorCritic`."""
    if augmented:
        return ActorCriticAug(num_actions=num_actions, width=width, fusion=fusion)
    return ActorCritic(num_actions=num_actions, width=width)

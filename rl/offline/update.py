"""The jitted AWR update: sample a batch on the device, decode it, one Adam step; many of them per dispatch.

Everything is a pure function of explicit state. The batch of update `u` is drawn with
`fold_in(PRNGKey(seed), u)`, so a run resumed from a checkpoint at update `u` continues exactly as the
uninterrupted run would have.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from rl.jit import compile_program
from rl.offline.data import Layout, decode_obs
from rl.offline.networks import normalise


def awr_loss(params, apply: Callable, obs, hidden, action, rtg, beta: float, weight_clip: float,
             value_coef: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AWR loss of one batch: advantage = rtg - V(s) (no gradient), centred over the batch; weight =
    min(exp(A / beta), weight_clip); loss = -mean(log pi(a|s) * w) + value_coef * mean((V(s) - rtg)^2)."""
    dist, value = apply(params, obs, hidden)
    adv = rtg - jax.lax.stop_gradient(value)
    adv = adv - adv.mean()
    w = jnp.minimum(jnp.exp(adv / beta), weight_clip)
    logp = dist.log_prob(action)
    actor = -(logp * w).mean()
    value_loss = ((value - rtg) ** 2).mean()
    loss = actor + value_coef * value_loss
    return loss, {"loss": loss, "actor_loss": actor, "value_loss": value_loss, "nll": -logp.mean(),
                  "weight_mean": w.mean(), "weight_clipped": (w >= weight_clip).mean()}


def batch_inputs(shard: dict[str, jax.Array], idx, layout: Layout, stats, mode: str, key):
    """The network inputs of rows `idx` of a device shard: (obs f32 [b, O], hidden f32 [b, D] | None, action, rtg).
    `mode` real = the held hidden state z-scored, zero = zeros (the dataset mean), shuffle = another row's."""
    obs = decode_obs(shard["bits"][idx], shard["rest"][idx], layout)
    hidden = None
    if mode != "none":
        hidden = normalise(shard["hidden"][idx], stats)
        if mode == "zero":
            hidden = jnp.zeros_like(hidden)
        elif mode == "shuffle":
            hidden = hidden[jax.random.permutation(key, hidden.shape[0])]
    return obs, hidden, shard["action"][idx], shard["rtg"][idx]


def make_train_chunk(apply: Callable, optimizer: optax.GradientTransformation, layout: Layout, *, mode: str,
                     batch_size: int, beta: float, weight_clip: float, value_coef: float, seed: int) -> Callable:
    """Jitted chunk(params, opt_state, shard, rows, stats, start, length) -> (params, opt_state, metrics):
    updates start .. start + length - 1 (`length` static) under one lax.scan, each on `batch_size` rows drawn
    uniformly from the shard's first `rows` (a traced count: padded shards of one shape share one compile).
    metrics: the mean of every loss term over the chunk."""
    base = jax.random.PRNGKey(seed)
    grad_fn = jax.grad(awr_loss, has_aux=True)

    def one(carry, u):
        params, opt_state, shard, rows, stats = carry
        k_idx, k_mix = jax.random.split(jax.random.fold_in(base, u))
        idx = jax.random.randint(k_idx, (batch_size,), 0, rows)
        obs, hidden, action, rtg = batch_inputs(shard, idx, layout, stats, mode, k_mix)
        grads, metrics = grad_fn(params, apply, obs, hidden, action, rtg, beta, weight_clip, value_coef)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, shard, rows, stats), metrics

    # no LLM in this program: XLA's default options (jaxllm.compile, through rl.llm.compile_program)
    @partial(compile_program, runs_llm=False, static_argnames="length", donate_argnums=(0, 1))
    def chunk(params, opt_state, shard, rows, stats, start, length: int):
        us = start + jnp.arange(length, dtype=jnp.int32)
        (params, opt_state, *_), metrics = jax.lax.scan(one, (params, opt_state, shard, rows, stats), us)
        return params, opt_state, jax.tree.map(jnp.mean, metrics)

    return chunk


def make_validation(apply: Callable, layout: Layout, *, mode: str, seed: int, batch: int = 1024) -> Callable:
    """Jitted val(params, shard, stats) -> {nll: -mean log pi(a|s), value_loss: mean (V(s) - rtg)^2, accuracy:
    how often the most likely action is the data's} over the shard's rows (in batches of `batch`; the shard's
    row count must be a multiple of it; rows with `valid` False are left out)."""

    def one(params, stats, shard, idx, key):
        obs, hidden, action, rtg = batch_inputs(shard, idx, layout, stats, mode, key)
        dist, value = apply(params, obs, hidden)
        v = shard["valid"][idx].astype(jnp.float32)
        logp = dist.log_prob(action)
        sums = {"nll": -(logp * v).sum(), "value_loss": (((value - rtg) ** 2) * v).sum(),
                "accuracy": ((dist.logits.argmax(-1) == action) * v).sum()}
        return sums, v.sum()

    @partial(compile_program, runs_llm=False)
    def val(params, shard, stats):
        n = shard["rtg"].shape[0]
        idx = jnp.arange(n).reshape(-1, batch)
        keys = jax.random.split(jax.random.PRNGKey(seed + 1), idx.shape[0])
        sums, count = jax.lax.map(lambda a: one(params, stats, shard, a[0], a[1]), (idx, keys))
        total = jnp.maximum(count.sum(), 1.0)
        return {k: v.sum() / total for k, v in sums.items()}

    return val


def init_state(net, optimizer, obs_size: int, hidden_size: int | None, seed: int) -> dict[str, Any]:
    """{"params", "opt_state", "update"} of a fresh run."""
    obs = jnp.zeros((1, obs_size), jnp.float32)
    hidden = None if hidden_size is None else jnp.zeros((1, hidden_size), jnp.float32)
    params = net.init(jax.random.PRNGKey(seed + 10_000), obs, hidden)
    return {"params": params, "opt_state": optimizer.init(params), "update": jnp.int32(0)}

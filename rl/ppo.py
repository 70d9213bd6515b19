"""PPO pieces (purejaxrl style): transitions, GAE, the clipped loss and one update over a rollout.

All functions are pure and jittable; the network is passed as its `apply` function. Under
`jax.shard_map` with the env axis split over devices, pass `axis_name` (and the global `env_index` of
the local envs): losses and gradients are averaged over the devices and the update equals the
one-device update.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rl.sharding import keys_per_index

SHUFFLES = ("global", "per_env")  # how an epoch splits the rollout into minibatches (see `ppo_update`)


class Transition(NamedTuple):
    """One env step of the whole batch (a rollout stacks these on a leading time axis)."""

    obs: jax.Array  # [B, O]
    hidden: jax.Array | None  # [B, D] LLM hidden state the policy saw, None without an encoder
    action: jax.Array  # int32 [B]
    log_prob: jax.Array  # [B]
    value: jax.Array  # [B]
    reward: jax.Array  # [B]
    done: jax.Array  # bool [B]: the episode ended at this step


@dataclass(frozen=True)
class PPOHyper:
    """PPO hyperparameters (defaults: the Craftax_Baselines reference trainer)."""

    gamma: float = 0.99
    gae_lambda: float = 0.8
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    update_epochs: int = 4
    num_minibatches: int = 8
    shuffle: str = "global"  # "global" (reference) or "per_env" (samples stay on their device); see ppo_update


def make_optimizer(lr: float, total_steps: int, *, anneal: bool = True, max_grad_norm: float = 1.0,
                   eps: float = 1e-5) -> optax.GradientTransformation:
    """Adam with global-norm clipping; LR linearly annealed to 0 over `total_steps` optimizer steps."""
    schedule = optax.linear_schedule(lr, 0.0, total_steps) if anneal else lr
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(schedule, eps=eps))


def gae(traj: Transition, last_value: jax.Array, gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimates and value targets for a time-major rollout [T, B]."""

    def body(carry, step):
        next_adv, next_value = carry
        done, reward, value = step
        not_done = 1.0 - done.astype(jnp.float32)
        delta = reward + gamma * next_value * not_done - value
        adv = delta + gamma * lam * not_done * next_adv
        return (adv, value), adv

    init = (jnp.zeros_like(last_value), last_value)
    _, adv = jax.lax.scan(body, init, (traj.done, traj.reward, traj.value), reverse=True)
    return adv, adv + traj.value


def batch_mean(x: jax.Array, axis_name: str | None = None) -> jax.Array:
    """Mean over all elements; with `axis_name`, over every device's (equally sized) share too."""
    m = jnp.mean(x)
    return m if axis_name is None else jax.lax.pmean(m, axis_name)


def ppo_loss(params, apply_fn: Callable, batch: Transition, adv: jax.Array, targets: jax.Array,
             hp: PPOHyper, axis_name: str | None = None):
    """Clipped PPO loss on one minibatch; returns (loss, aux metrics).

    With `axis_name` the minibatch is spread over devices: the advantages are normalised with the whole
    minibatch's mean and std, and the loss is this device's share (average it, and its gradient, with
    `jax.lax.pmean`; the shares are equal in size).
    """
    pi, value = apply_fn(params, batch.obs, batch.hidden)
    log_prob = pi.log_prob(batch.action)

    value_clipped = batch.value + jnp.clip(value - batch.value, -hp.clip_eps, hp.clip_eps)
    value_loss = 0.5 * jnp.maximum(jnp.square(value - targets), jnp.square(value_clipped - targets)).mean()

    ratio = jnp.exp(log_prob - batch.log_prob)
    adv_mean = batch_mean(adv, axis_name)
    adv = (adv - adv_mean) / (jnp.sqrt(batch_mean(jnp.square(adv - adv_mean), axis_name)) + 1e-8)
    actor_loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - hp.clip_eps, 1 + hp.clip_eps) * adv).mean()
    entropy = pi.entropy().mean()
    total = actor_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
    aux = {
        "value_loss": value_loss,
        "actor_loss": actor_loss,
        "entropy": entropy,
        "approx_kl": ((ratio - 1) - jnp.log(ratio)).mean(),
        "clip_frac": (jnp.abs(ratio - 1) > hp.clip_eps).mean(),
    }
    return total, aux


def per_env_time_index(key: jax.Array, num_steps: int, env_index: jax.Array) -> jax.Array:
    """int32 [T, B]: column b is a permutation of env b's time steps, keyed by fold_in(key, env_index[b]).

    env_index holds the global env indices, so the index (and hence training) does not depend on how the
    envs are split over devices.
    """
    return jax.vmap(lambda k: jax.random.permutation(k, num_steps), out_axes=1)(keys_per_index(key, env_index))


def _global_minibatches(data, key: jax.Array, num_minibatches: int, env_index, axis_name):
    """Reference shuffle: one permutation of all T*B samples of the whole batch -> leaves [M, T*B/M, ...].
    With `axis_name`, `data` is the whole batch's rollout (gathered by the caller) and this device keeps
    its 1/N share of each minibatch."""
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), data)
    perm = jax.random.permutation(key, flat[2].shape[0]).reshape(num_minibatches, -1)
    if axis_name is not None:
        share = perm.shape[1] // jax.lax.axis_size(axis_name)
        perm = jax.lax.dynamic_slice_in_dim(perm, jax.lax.axis_index(axis_name) * share, share, axis=1)
    return jax.tree.map(lambda x: x[perm], flat)


def _per_env_minibatches(data, key: jax.Array, num_minibatches: int, env_index, axis_name):
    """Per-env shuffle: permute each env's time steps; minibatch m takes time slots
    [m*T/M, (m+1)*T/M) of every env -> leaves [M, T/M, B, ...] (the env axis stays where it is)."""
    num_steps = data[2].shape[0]
    index = per_env_time_index(key, num_steps, env_index)

    def split(x):
        shuffled = jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=0)
        return shuffled.reshape((num_minibatches, num_steps // num_minibatches) + x.shape[1:])

    return jax.tree.map(split, data)


def ppo_update(params, opt_state, optimizer: optax.GradientTransformation, apply_fn: Callable,
               traj: Transition, last_value: jax.Array, key: jax.Array, hp: PPOHyper,
               axis_name: str | None = None, env_index: jax.Array | None = None):
    """`update_epochs` x `num_minibatches` PPO steps on one rollout [T, B].

    Under `jax.shard_map` pass `axis_name` (the mesh axis splitting the envs) and `env_index` (int [B], the
    global indices of this device's envs): losses, advantage statistics and so the gradients are over the
    whole batch, and params stay identical on every device.

    `hp.shuffle` picks how each epoch forms minibatches:
      * "global" (the reference): samples are flattened over (time, env) and permuted together. With the
        env axis split over devices this permutation mixes every device's samples: each device all-gathers
        the rollout once per update and computes its share of every minibatch.
      * "per_env": each env's time steps are permuted (key folded with the global env index) and
        minibatch m takes the same number of time slots from every env ([T/M, B] samples). The gather runs
        along the time axis, so each device keeps its own envs and only the advantage statistics, the
        loss scalars and the gradients are all-reduced. Needs T % M == 0. Same algorithm, other minibatch composition.
    Returns (params, opt_state, metrics averaged over all minibatch steps).
    """
    adv, targets = gae(traj, last_value, hp.gamma, hp.gae_lambda)
    num_steps, num_envs = traj.reward.shape
    if hp.shuffle not in SHUFFLES:
        raise ValueError(f"shuffle {hp.shuffle!r} is not one of: {', '.join(SHUFFLES)}")
    if hp.shuffle == "per_env" and num_steps % hp.num_minibatches:
        raise ValueError(f"shuffle per_env splits each env's {num_steps} steps into {hp.num_minibatches} "
                         "minibatches: num_steps must be a multiple of num_minibatches")
    if num_steps * num_envs % hp.num_minibatches:
        raise ValueError(f"this device's batch of {num_steps * num_envs} samples does not split into "
                         f"{hp.num_minibatches} minibatches")
    if axis_name is not None and env_index is None:
        raise ValueError("ppo_update over a device axis needs env_index (the global indices of this device's envs)")
    env_index = jnp.arange(num_envs) if env_index is None else env_index
    data = (traj, adv, targets)
    if hp.shuffle == "global" and axis_name is not None:  # every device needs every sample: gather once
        data = (traj._replace(reward=None, done=None), adv, targets)  # the loss does not read these
        data = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True), data)
    make_minibatches = _per_env_minibatches if hp.shuffle == "per_env" else _global_minibatches
    grad_fn = jax.value_and_grad(ppo_loss, has_aux=True)

    def minibatch_step(carry, mb):
        params, opt_state = carry
        batch, mb_adv, mb_targets = mb
        (loss, aux), grads = grad_fn(params, apply_fn, batch, mb_adv, mb_targets, hp, axis_name)
        if axis_name is not None:  # equal shares: the mean of the devices' means is the minibatch mean
            loss, aux, grads = jax.lax.pmean((loss, aux, grads), axis_name)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), dict(aux, total_loss=loss)

    def epoch(carry, k):
        minibatches = make_minibatches(data, k, hp.num_minibatches, env_index, axis_name)
        return jax.lax.scan(minibatch_step, carry, minibatches)

    (params, opt_state), metrics = jax.lax.scan(epoch, (params, opt_state),
                                                jax.random.split(key, hp.update_epochs))
    return params, opt_state, jax.tree.map(jnp.mean, metrics)

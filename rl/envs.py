"""Batched Craftax environments for the trainer: episode logging and optimistic resets.

`BatchedEnv` steps a whole batch of craftax environments (the raw `NoAutoReset` envs, vmapped) and
keeps per-env episode statistics. When envs finish an episode they are reset *optimistically*: each
step generates a small pool of fresh worlds (one per block of `reset_ratio` consecutive envs: 64 for
1,024 envs as in the reference trainer) instead of one per env, and a done env copies its block's world.
World generation is the expensive part of a Craftax step, so this keeps the step cheap. Two envs share
a fresh world only when they are in the same block and finish on the same step (their futures still
differ: every env has its own step key).

Every random key is derived from the global index of its env (or block), never from the batch
position, so a batch split over devices (each device stepping its own envs, `env_index` giving their
global indices) behaves exactly like the whole batch on one device.

Everything here is a pure function of explicit state, works on whatever batch it is given (a
per-device shard included) and runs under jit / lax.scan.

Two settings change the kernels, never the results (`rl.config.SpeedConfig`): `env_unroll` fully unrolls Craftax's
own short inner scans in the step and the reset (`rl.unroll`), and `lazy_reset` draws a step's fresh worlds under a
`lax.cond` that runs only when an env finished (the worlds are read only by envs that finished).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from render.envs import achievement_names, make_raw_env
from rl.sharding import keys_per_index
from rl.unroll import unroll_short_scans


def _strong(x: jax.Array) -> jax.Array:
    return jnp.asarray(x, dtype=x.dtype)


class EnvBatchState(NamedTuple):
    """Batched env state plus the running statistics of each env's current episode."""

    env_state: Any  # raw craftax EnvState, leading axis = env
    episode_return: jax.Array  # float32 [B]
    episode_length: jax.Array  # int32 [B]


class StepInfo(NamedTuple):
    """What one batched step reports besides obs/reward/done (values are 0 where not done)."""

    episode_return: jax.Array  # float32 [B]: return of the episode that just ended
    episode_length: jax.Array  # int32 [B]
    achievements: jax.Array  # bool [B, A]: achievements of the episode that just ended


@dataclass(frozen=True)
class BatchedEnv:
    """A batch of `num_envs` Craftax envs with episode logging and optimistic resets. `env_unroll`, `lazy_reset`: how
    the step is compiled (module docstring); the results are the same."""

    env_name: str
    num_envs: int
    reset_ratio: int = 16
    env_unroll: int = 0
    lazy_reset: bool = False

    def __post_init__(self):
        if self.num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {self.num_envs}")
        if self.reset_ratio < 1:
            raise ValueError(f"reset_ratio must be >= 1, got {self.reset_ratio}")
        env, params = make_raw_env(self.env_name)
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "achievement_names", achievement_names(self.env_name))
        # the env params are read when a program is traced (tests shorten episodes by replacing them before that)
        step = lambda keys, state, action: jax.vmap(env.step, in_axes=(0, 0, 0, None))(keys, state, action,  # noqa: E731
                                                                                         self._params)
        reset = lambda keys: jax.vmap(env.reset, in_axes=(0, None))(keys, self._params)  # noqa: E731
        object.__setattr__(self, "_step_batch", unroll_short_scans(step, self.env_unroll))
        object.__setattr__(self, "_reset_batch", unroll_short_scans(reset, self.env_unroll))

    # static facts ---------------------------------------------------------------------------
    @property
    def raw_env(self):
        return self._env

    @property
    def env_params(self):
        return self._params

    @property
    def num_actions(self) -> int:
        return int(self._env.num_actions)

    # dynamics -------------------------------------------------------------------------------
    def reset(self, key: jax.Array, env_index: jax.Array | None = None) -> tuple[jax.Array, EnvBatchState]:
        """Fresh worlds for the envs `env_index` (default: all): (obs float32 [B, O], state)."""
        env_index = jnp.arange(self.num_envs) if env_index is None else env_index
        obs, env_state = self._reset_batch(keys_per_index(key, env_index))
        env_state = jax.tree.map(_strong, env_state)  # craftax leaves some fields weakly typed
        zeros_f = jnp.zeros(env_index.shape, jnp.float32)
        zeros_i = jnp.zeros(env_index.shape, jnp.int32)
        return obs, EnvBatchState(env_state, zeros_f, zeros_i)

    def reset_pool(self, key: jax.Array, env_index: jax.Array) -> tuple[jax.Array, Any]:
        """Fresh worlds for the optimistic-reset blocks of the envs `env_index` (a contiguous run that starts a
        block or lies inside one): (obs [W, O], raw craftax state [W]), world w for block `block_slots(...)==w`.
        Keyed by global block index, so a device holding some of the envs gets the same worlds for them."""
        first_block = env_index[0] // self.reset_ratio
        worlds = first_block + jnp.arange(-(-env_index.shape[0] // self.reset_ratio))  # the blocks of this batch
        obs, state = self._reset_batch(keys_per_index(key, worlds))
        return obs, jax.tree.map(_strong, state)

    def _fresh_worlds(self, key: jax.Array, env_index: jax.Array, done: jax.Array) -> tuple[jax.Array, Any]:
        """The step's `reset_pool(key, env_index)`; with `lazy_reset`, drawn only when an env is `done` (zeros of the
        same shapes otherwise, which no env reads)."""
        draw = lambda: self.reset_pool(key, env_index)  # noqa: E731
        if not self.lazy_reset:
            return draw()
        shapes = jax.eval_shape(draw)
        nothing = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
        return jax.lax.cond(jnp.any(done), draw, nothing)

    def block_slots(self, env_index: jax.Array) -> jax.Array:
        """int [B]: each env's row in `reset_pool(key, env_index)`."""
        block = env_index // self.reset_ratio
        return block - block[0]

    def step(self, key: jax.Array, state: EnvBatchState, action: jax.Array, env_index: jax.Array | None = None,
             pool: tuple[jax.Array, Any] | None = None):
        """Step the envs `env_index` (default: all; a contiguous run that starts a block or lies inside
        one, e.g. one device's share); done envs restart in their block's fresh world.

        The fresh worlds are drawn for this step (`reset_pool` with a key split from `key`), or taken from
        `pool` (a `reset_pool` result drawn earlier, e.g. once per LLM window).
        Returns (obs [B, O], state, reward float32 [B], done bool [B], StepInfo). `obs` and `state`
        of a done env are already those of its new episode, as with gymnax auto-reset.
        """
        batch = action.shape[0]
        env_index = jnp.arange(batch) if env_index is None else env_index
        k_step, k_reset = jax.random.split(key)
        obs, env_state, reward, done, _ = self._step_batch(keys_per_index(k_step, env_index), state.env_state, action)
        reward = reward.astype(jnp.float32)
        done = done.astype(bool)
        ep_return = state.episode_return + reward
        ep_length = state.episode_length + 1
        info = StepInfo(
            episode_return=jnp.where(done, ep_return, 0.0),
            episode_length=jnp.where(done, ep_length, 0),
            achievements=env_state.achievements.astype(bool) & done[:, None],
        )

        pool_obs, pool_state = self._fresh_worlds(k_reset, env_index, done) if pool is None else pool
        slot = self.block_slots(env_index)  # env -> its block's world

        def pick(fresh, old):
            chosen = fresh[slot]
            mask = done.reshape(done.shape + (1,) * (old.ndim - 1))
            return jnp.where(mask, chosen, old)

        env_state = jax.tree.map(pick, pool_state, env_state)
        obs = pick(pool_obs, obs)
        new_state = EnvBatchState(
            env_state, jnp.where(done, 0.0, ep_return), jnp.where(done, 0, ep_length)
        )
        return obs, new_state, reward, done, info

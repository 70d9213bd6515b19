"""The PPO trainer: rollout (with or without an LLM hidden state) + PPO update, as jitted functions.

One training update = a rollout of `num_steps` steps of `num_envs` envs followed by
`update_epochs x num_minibatches` PPO steps. With `--encoder inscan` the whole update is ONE jitted
function, and the LLM reads the envs' states once per window of `skip_n` steps, wherever the window falls:
the window's clock (`LLMWindow.clock`, steps left) and the hidden state live in the runner state and carry
across rollouts, so a window may start anywhere in a rollout and span several. At the step that ends a
window the new states are encoded (template -> Qwen3 -> h) under a `lax.cond` on the clock: a rollout
without a window boundary runs no LLM at all. `skip_n` 0 encodes once, at the start of the run.

Resets inside a window (`cfg.reset_hidden`, docs/TRAINING.md): with "pool" (the default for in-scan with
skip_n > 0) every window start also draws one fresh world per optimistic-reset block (`BatchedEnv.reset_pool`)
and encodes it in the same LLM call; an env that finishes an episode inside the window restarts in its
block's pool world and acts on that world's real hidden state (extra prompts per window: num_envs /
reset_ratio). With "zero" a reset env acts on a zero vector, meaning "no LLM reading yet", until the
window ends. Either way a new episode never sees its predecessor's vector.

Several devices (`cfg.devices`, docs/MULTIGPU.md): every jitted function is a `jax.shard_map` over a
1-D device mesh (`rl.sharding`). The runner state's per-env fields are split over it and everything
else is replicated (`RunnerState.specs`, `RolloutCarry.specs`); each device steps, renders, encodes and
acts for its own envs, with random keys derived from global env indices, and the PPO losses and
gradients are averaged over all devices. The result equals a one-device run of the same global batch up to float reassociation.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl.config import TrainConfig, resolve_devices
from rl.encoders import LLMArgs, make_inscan_encoder, make_token_fn
from rl.envs import BatchedEnv, EnvBatchState, StepInfo
from rl.networks import make_network
from rl.ppo import PPOHyper, Transition, make_optimizer, ppo_update
from rl.sharding import (ENV_AXIS, from_process_local_rows, keys_per_index, make_mesh, process_local_rows,
                         replicated)


class LLMWindow(NamedTuple):
    """The in-scan LLM's window, carried from step to step and rollout to rollout (checkpointed)."""

    clock: jax.Array  # int32 scalar: steps left in the current window (unused with skip_n 0)
    pool: tuple[jax.Array, Any] | None  # (obs [W, O], raw states [W]): one fresh world per reset block ("pool")
    pool_hidden: jax.Array | None  # [W, D]: their hidden states, encoded with the window's envs

    @staticmethod
    def specs(pooled: bool) -> "LLMWindow":
        env = P(ENV_AXIS)
        return LLMWindow(P(), (env, env) if pooled else None, env if pooled else None)


class RunnerState(NamedTuple):
    """Everything a run carries from one update to the next (all of it is checkpointed)."""

    params: Any
    opt_state: Any
    env_state: EnvBatchState
    obs: jax.Array  # [B, O]
    hidden: jax.Array | None  # [B, D] for LLM encoders (what the next step reads), else None
    rng: jax.Array  # PRNG key (uint32[2])
    update: jax.Array  # int32 scalar: updates done so far
    window: LLMWindow | None = None  # in-scan only

    @staticmethod
    def specs(uses_hidden: bool, window: LLMWindow | None = None) -> "RunnerState":
        """The `PartitionSpec` of each field (for shard_map): per-env fields split over the env axis.
        `window`: `LLMWindow.specs(...)` for in-scan runs."""
        env = P(ENV_AXIS)
        return RunnerState(params=P(), opt_state=P(), env_state=env, obs=env, hidden=env if uses_hidden else None,
                           rng=P(), update=P(), window=window)

    def shardings(self, mesh: Mesh) -> "RunnerState":
        """A sharding for every leaf: `specs` on `mesh`."""
        window = None if self.window is None else LLMWindow.specs(pooled=self.window.pool is not None)
        specs = RunnerState.specs(uses_hidden=self.hidden is not None, window=window)
        return jax.tree.map(lambda spec, value: jax.tree.map(lambda _: NamedSharding(mesh, spec), value),
                            specs, self, is_leaf=lambda x: isinstance(x, P))


class RolloutCarry(NamedTuple):
    """What the rollout's scan carries from one env step to the next (per-env fields split over devices)."""

    env_state: EnvBatchState
    obs: jax.Array  # [B, O]
    hidden: jax.Array | None  # [B, D] the policy reads (held over a window), else None
    key: jax.Array  # PRNG key of the rollout
    window: LLMWindow | None = None  # in-scan: the window's clock and reset pool

    @staticmethod
    def specs(uses_hidden: bool, window: LLMWindow | None = None) -> "RolloutCarry":
        env = P(ENV_AXIS)
        return RolloutCarry(env, env, env if uses_hidden else None, P(), window)


class Trainer:
    """Builds the env, network, optimizer and jitted update of a `TrainConfig`.

    `llm` is an `rl.encoders.LLMSetup` for `inscan` / `vllm` (None for `none`). For `vllm` pass
    `vllm_encoder` (an `rl.encoders.VLLMEncoder`); `rl.encoders.load_encoder` gives both. The env batch is
    split over `cfg.devices` devices (0 = all visible; `self.cfg` holds the resolved count): `self.mesh`;
    pass LLM arguments through `place_llm_args` once.
    """

    def __init__(self, cfg: TrainConfig, llm=None, vllm_encoder=None):
        self.cfg = cfg = resolve_devices(cfg)
        self.num_devices = cfg.devices
        self.mesh = make_mesh(self.num_devices)
        self.local_envs = cfg.num_envs // self.num_devices
        self.env = BatchedEnv(cfg.env, cfg.num_envs, cfg.reset_ratio)
        self.network = make_network(self.env.num_actions, augmented=cfg.uses_llm, fusion=cfg.fusion,
                                    width=cfg.width)
        self.hp = PPOHyper(cfg.gamma, cfg.gae_lambda, cfg.clip_eps, cfg.ent_coef, cfg.vf_coef,
                           cfg.update_epochs, cfg.num_minibatches, cfg.shuffle)
        self.optimizer = make_optimizer(cfg.lr, cfg.num_updates * cfg.update_epochs * cfg.num_minibatches,
                                        anneal=cfg.anneal_lr, max_grad_norm=cfg.max_grad_norm, eps=cfg.adam_eps)
        self.llm = llm
        self.vllm = vllm_encoder
        if cfg.uses_llm and llm is None:
            raise ValueError(f"--encoder {cfg.encoder} needs an LLM setup (rl.encoders.load_encoder)")
        self._encode = None
        window = None
        if cfg.encoder == "inscan":
            self._encode = make_inscan_encoder(llm.template, llm.model.config, layer=cfg.llm_layer,
                                               pooling=cfg.pooling, method=cfg.llm_encode,
                                               capacity=cfg.llm_capacity, chunk=cfg.llm_chunk)
            window = LLMWindow.specs(pooled=cfg.hidden_on_reset == "pool")
        specs = RunnerState.specs(uses_hidden=cfg.uses_llm, window=window)
        carry = RolloutCarry.specs(uses_hidden=cfg.uses_llm, window=window)
        rep, env, steps = P(), P(ENV_AXIS), P(None, ENV_AXIS)
        if cfg.encoder == "vllm":
            if vllm_encoder is None:
                raise ValueError("--encoder vllm needs the server's client (rl.encoders.load_encoder)")
            self._tokens = self._sharded(make_token_fn(llm.template), env, (env, env))
        self.records = cfg.save_trajectories is not None  # the update also returns its rollout's samples
        self.update = self._sharded(functools.partial(self._update, record=self.records), (specs, rep),
                                    (specs, rep, steps) if self.records else (specs, rep))
        self.encode_states = self._sharded(self._encode, (rep, rep, env), env) if self._encode else None
        self._open = None
        if self._encode is not None:
            open_window = lambda args, es, key: self._open_window(LLMArgs(*args), es, key, self._env_index())
            self._open = self._sharded(open_window, (rep, env, rep), (env, window))
        self._reset = self._sharded(lambda key: self.env.reset(key, self._env_index()), rep, (env, env))
        self._window = self._sharded(lambda p, c: self.run_window(p, c, cfg.skip_n, env_index=self._env_index()),
                                     (rep, carry), (carry, steps))
        finish_chunks = lambda runner, c, k, chunks: self._finish_update(runner, c, k, *_concat_steps(chunks))
        self._finish = self._sharded(finish_chunks, (specs, carry, rep, steps), (specs, rep))  # vllm path

    # setup ------------------------------------------------------------------------------------
    def _sharded(self, fn, in_specs, out_specs):
        """`fn` jitted as a shard_map over the env axis: per-env arguments (spec P(ENV_AXIS)) arrive as
        this device's rows, replicated ones (P()) whole. Replication is not type-checked (craftax's own
        scans are not written for it); every collective is explicit (`rl.ppo`, `episode_metrics`)."""
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def _env_index(self) -> jax.Array:
        """Global indices of this device's envs (inside a shard_map; all envs on one device)."""
        return jax.lax.axis_index(ENV_AXIS) * self.local_envs + jnp.arange(self.local_envs)

    def apply(self, params, obs, hidden):
        return self.network.apply(params, obs, hidden)

    def place_llm_args(self, llm_args=LLMArgs()) -> LLMArgs:
        """The LLM params and prefix cache, replicated over the mesh (a no-op for `LLMArgs()`)."""
        return jax.device_put(LLMArgs(*llm_args), replicated(self.mesh))

    def place(self, runner: RunnerState) -> RunnerState:
        """`runner` with its per-env fields split over the mesh and the rest replicated."""
        return jax.device_put(runner, runner.shardings(self.mesh))

    def init_state(self, llm_args=LLMArgs()) -> RunnerState:
        """Initial params, optimizer state, envs and (for LLM encoders) the first hidden states,
        placed on the mesh. The values do not depend on the device count."""
        key = jax.random.PRNGKey(self.cfg.seed)
        key, k_net, k_env = jax.random.split(key, 3)
        obs, env_state = self._reset(k_env)
        hidden = window = None
        if self._encode is not None:  # the first window (and its reset pool) starts now
            hidden, window = self._open(self.place_llm_args(llm_args), env_state, jax.random.fold_in(k_env, 1))
        elif self.vllm is not None:
            hidden = self._vllm_hidden(env_state)
        # init reads only shapes; zeros (not obs[:1]) since with several processes obs is not all on this host
        dummy_h = None if hidden is None else jnp.zeros((1,) + hidden.shape[1:], hidden.dtype)
        params = self.network.init(k_net, jnp.zeros((1,) + obs.shape[1:], obs.dtype), dummy_h)
        opt_state = self.optimizer.init(params)
        return self.place(RunnerState(params, opt_state, env_state, obs, hidden, key, jnp.zeros((), jnp.int32),
                                      window))

    # rollout ----------------------------------------------------------------------------------
    def _open_window(self, llm_args: LLMArgs, env_state: EnvBatchState, key, env_index):
        """A window starts on `env_state`: the envs' hidden states [B, D] and the new `LLMWindow` (clock =
        skip_n; with the "pool" reset policy, one fresh world per reset block drawn with `key`, encoded in the
        same LLM call as the envs)."""
        clock = jnp.asarray(self.cfg.skip_n, jnp.int32)
        raw = env_state.env_state
        if self.cfg.hidden_on_reset != "pool":
            return self._encode(*llm_args, raw), LLMWindow(clock, None, None)
        pool = self.env.reset_pool(key, env_index)
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), raw, pool[1])
        hidden = self._encode(*llm_args, both)
        batch = env_index.shape[0]
        return hidden[:batch], LLMWindow(clock, pool, hidden[batch:])

    def _act(self, params, carry: RolloutCarry, env_index, llm_args: LLMArgs | None = None):
        """One env+policy step. With `llm_args` (in-scan) the window's clock ticks, and the step that ends a
        window encodes the new states (`lax.cond`: no LLM work on other steps)."""
        key, k_act, k_env = jax.random.split(carry.key, 3)
        pi, value = self.apply(params, carry.obs, carry.hidden)
        action = jax.vmap(jax.random.categorical)(keys_per_index(k_act, env_index), pi.logits)
        log_prob = pi.log_prob(action)
        window = carry.window
        pool = window.pool if window is not None else None
        next_obs, next_state, reward, done, info = self.env.step(k_env, carry.env_state, action, env_index, pool)
        hidden = carry.hidden
        if hidden is not None:  # a new episode must not see the previous episode's vector
            fresh = (jnp.zeros_like(hidden) if pool is None
                     else window.pool_hidden[self.env.block_slots(env_index)])  # its pool world's reading
            hidden = jnp.where(done[:, None], fresh, hidden)
        if llm_args is not None and window is not None and self.cfg.skip_n > 0:
            window = window._replace(clock=window.clock - 1)
            k_pool = jax.random.split(k_env)[1]  # the step's own reset key, unused when the pool resets

            def new_window(hidden, window):
                return self._open_window(llm_args, next_state, k_pool, env_index)

            hidden, window = jax.lax.cond(window.clock == 0, new_window, lambda h, w: (h, w), hidden, window)
        tr = Transition(carry.obs, carry.hidden, action, log_prob, value, reward, done)
        return RolloutCarry(next_state, next_obs, hidden, key, window), (tr, info, carry.env_state.env_state)

    def run_window(self, params, carry: RolloutCarry, length: int, keep_states: bool = False, env_index=None,
                   llm_args: LLMArgs | None = None):
        """`length` env+policy steps -> (carry, (Transition [T, B], StepInfo [T, B], raw env states [T, B] or
        None)). Without `llm_args` the hidden state is held (reset envs per `carry.window`, zeros without one);
        with them the in-scan LLM's windows run as in training. `env_index`: global indices of the envs in
        `carry` (default: 0..B-1, the whole batch on one device). Done envs restart (`BatchedEnv.step`)."""
        if env_index is None:
            env_index = jnp.arange(carry.obs.shape[0])
        carry, (tr, info, states) = jax.lax.scan(lambda c, _: self._act(params, c, env_index, llm_args), carry,
                                                 None, length)
        return carry, (tr, info, states if keep_states else None)

    def rollout(self, params, carry: RolloutCarry, llm_args: LLMArgs, keep_states: bool = False, env_index=None):
        """One rollout of num_steps steps from `carry` -> (RolloutCarry, Transition [T, B], StepInfo [T, B],
        states or None). In-scan, `carry.window` (the runner's) says where the current LLM window stands.

        Runs on one device's envs inside the update's shard_map (`env_index`: their global indices), or on
        all envs when called directly. `keep_states=True` also returns every step's raw env state (for tests).
        """
        if self.vllm is not None:
            raise RuntimeError("the vllm encoder rolls out on the host; use Trainer.step")
        carry, (tr, info, states) = self.run_window(params, carry, self.cfg.num_steps, keep_states, env_index,
                                                    LLMArgs(*llm_args) if self._encode is not None else None)
        return carry, tr, info, states

    # update -----------------------------------------------------------------------------------
    def _finish_update(self, runner: RunnerState, carry: RolloutCarry, key_ppo, traj: Transition, info: StepInfo):
        """PPO on this device's rollout (losses and gradients averaged over all devices) -> (runner, metrics).
        `carry.key` becomes the runner's next key."""
        _, last_value = self.apply(runner.params, carry.obs, carry.hidden)
        params, opt_state, losses = ppo_update(runner.params, runner.opt_state, self.optimizer, self.apply,
                                               traj, last_value, key_ppo, self.hp, axis_name=ENV_AXIS,
                                               env_index=self._env_index())
        metrics = dict(losses, **episode_metrics(info, ENV_AXIS))
        if traj.hidden is not None:
            metrics["hidden_zero_frac"] = jax.lax.pmean(jnp.mean(jnp.all(traj.hidden == 0, axis=-1)), ENV_AXIS)
        return RunnerState(params, opt_state, carry.env_state, carry.obs, carry.hidden, carry.key,
                           runner.update + 1, carry.window), metrics

    def _update(self, runner: RunnerState, llm_args: LLMArgs, record: bool = False):
        """One full training update (rollout + PPO) as a pure function; jitted as `self.update`. With `record`
        it also returns the rollout's (obs, action, reward, done, log_prob), each [T, B, ...]."""
        key, k_roll, k_ppo = jax.random.split(runner.rng, 3)
        start = RolloutCarry(runner.env_state, runner.obs, runner.hidden, k_roll, runner.window)
        carry, traj, info, _ = self.rollout(runner.params, start, llm_args, env_index=self._env_index())
        runner, metrics = self._finish_update(runner, carry._replace(key=key), k_ppo, traj, info)
        if not record:
            return runner, metrics
        return runner, metrics, (traj.obs, traj.action, traj.reward, traj.done, traj.log_prob)

    def dispatch(self, runner: RunnerState, llm_args=LLMArgs(), on_rollout: Callable | None = None):
        """Start one update; returns (runner, metrics) as device arrays that are still being computed (nothing
        waits for them; `on_rollout` as in `step`), except on the `vllm` host loop, which runs the update through."""
        if self.vllm is None:
            out = self.update(runner, LLMArgs(*llm_args))
            if on_rollout is not None and self.records:
                obs, action, reward, done, log_prob = out[2]
                on_rollout(obs, out[0].obs, action, reward, done, log_prob)
            return out[:2]
        return self.step(runner, llm_args, on_rollout)

    def step(self, runner: RunnerState, llm_args=LLMArgs(), on_rollout: Callable | None = None):
        """Advance one update; returns (runner, metrics as numpy). Host loop only for `vllm`.

        on_rollout (with `cfg.save_trajectories`): called with the rollout's device arrays (obs [T, B, O], the
        observation after its last step [B, O], action, reward, done, log_prob [T, B]) before the metrics are
        fetched, e.g. `rl.trajectories.TrajectoryWriter.add_rollout`, which copies them while the next update runs.
        """
        if self.vllm is None:
            runner, metrics = self.dispatch(runner, llm_args, on_rollout)
            return runner, jax.device_get(metrics)
        key, k_roll, k_ppo = jax.random.split(runner.rng, 3)
        carry = RolloutCarry(runner.env_state, runner.obs, runner.hidden, k_roll)
        chunks = []
        for _ in range(self.cfg.num_steps // self.cfg.skip_n):
            carry, out = self._window(runner.params, carry)
            chunks.append(out[:2])
            carry = carry._replace(hidden=self._vllm_hidden(carry.env_state))
        runner, metrics = self._finish(runner, carry._replace(key=key), k_ppo, chunks)
        if on_rollout is not None and self.records:
            tr = _concat_steps([tr for tr, _ in chunks])
            on_rollout(tr.obs, runner.obs, tr.action, tr.reward, tr.done, tr.log_prob)
        return runner, jax.device_get(metrics)

    def _vllm_hidden(self, env_state: EnvBatchState) -> jax.Array:
        """Hidden states from the server, placed split over the mesh like every per-env array.
        Each process sends only its own envs' prompts (all of them when there is one process)."""
        ids, lengths = (process_local_rows(x) for x in self._tokens(env_state.env_state))
        return from_process_local_rows(self.vllm(ids, lengths), self.mesh, self.cfg.num_envs)

    def update_from_clock(self, runner: RunnerState, llm_args: LLMArgs, clock: int):
        """One update from `runner` with its LLM window clock set to `clock` (num_steps + 1: no window opens; 1: one at
        the first step, then every skip_n), for timing the in-scan LLM (rl.llm_share); the outputs are to be thrown
        away. None without an in-scan LLM."""
        if self._encode is None or runner.window is None:
            return None
        at = jax.device_put(jnp.asarray(clock, jnp.int32), runner.window.clock.sharding)
        return self.update(runner._replace(window=runner.window._replace(clock=at)), LLMArgs(*llm_args))


def _concat_steps(chunks):
    """The windows' (Transition, StepInfo) pairs joined along the time axis."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *chunks)


def episode_metrics(info: StepInfo, axis_name: str | None = None) -> dict[str, jax.Array]:
    """Means over the episodes that ended during a rollout (NaN when none ended); with `axis_name`, over
    every device's envs."""
    total = (lambda x: x) if axis_name is None else (lambda x: jax.lax.psum(x, axis_name))
    n = total((info.episode_length > 0).astype(jnp.float32).sum())
    safe = jnp.maximum(n, 1.0)
    nan_if_none = lambda x: jnp.where(n > 0, x, jnp.nan)
    return {
        "episodes": n,
        "episode_return": nan_if_none(total(info.episode_return.sum()) / safe),
        "episode_length": nan_if_none(total(info.episode_length.sum().astype(jnp.float32)) / safe),
        "achievements": nan_if_none(total(info.achievements.sum(axis=(0, 1)).astype(jnp.float32)) / safe),
    }

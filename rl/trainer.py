"""The PPO trainer: rollout (with or without an LLM hidden state) + PPO update, as jitted functions.

One training update = a rollout of `num_steps` steps of `num_envs` envs followed by
`update_epochs x num_minibatches` PPO steps. With `--encoder inscan` the whole update is ONE jitted
function, and the LLM reads the envs' states once per window of `skip_n` steps, wherever the window falls:
the window's clock (`LLMWindow.clock`, steps left) and the hidden state live in the runner state and carry
across rollouts, so a window may start anywhere in a rollout and span several. At the step that ends a
window the new states are encoded (template -> Qwen3 -> h) under a `lax.cond` on the clock: a rollout
without a window boundary runs no LLM at all. `skip_n` 0 encodes once, at the start of the run.

Resets inside a window (`--reset-hidden`, docs/TRAINING.md): with "pool" (the default for in-scan with
skip_n > 0) every window start also draws one fresh world per optimistic-reset block (`BatchedEnv.reset_pool`)
and encodes it in the same LLM call; an env that finishes an episode inside the window restarts in its
block's pool world and acts on that world's real hidden state (extra prompts per window: num_envs /
reset_ratio). With "zero" a reset env acts on a zero vector, meaning "no LLM reading yet", until the
window ends. Either way a new episode never sees its predecessor's vector.

Several devices (`--devices`, docs/MULTIGPU.md): every jitted function is a `jax.shard_map` over a
1-D device mesh (`rl.sharding`). The runner state's per-env fields are split over it and everything
else is replicated (`RunnerState.specs`, `RolloutCarry.specs`); each device steps, renders, encodes and
acts for its own envs, with random keys derived from global env indices, and the PPO losses and
gradients are averaged over all devices. The result equals a one-device run of the same global batch up to float reassociation.

The rollout is the trainer's own scan (`_act`, `run_window`), not `rl.play`'s loop: it is the timed program, its LLM
windows open inside the scan on a clock that carries across rollouts (with reset pools), and it runs inside the
update's shard_map; sharing the play loop would need a GPU run to show its speed unchanged. The play loop builds on
it instead: eval and video play through `run_window` (`rl.play.trainer_window`), so they act exactly as in training.
The encoder kind gets what it builds with as one explicit value (`rl.update_parts.UpdateParts`), never the trainer.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.compile import jit as jit_with_options
from rl.config import EnvConfig, PPOConfig, SpeedConfig, TrainConfig, resolve_devices
from rl.encoder_kinds import Encoder, LLMWindow, make_encoder, recorded_rollout
from rl.llm import LLMArgs
from rl.envs import BatchedEnv, EnvBatchState, StepInfo
from rl.networks import make_network
from rl.ppo import PPOHyper, Transition, make_optimizer, ppo_update
from rl.sharding import ENV_AXIS, keys_per_index, make_mesh, replicated
from rl.trajectories import RecordedRollout
from rl.update_parts import UpdateParts


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

    def rollout_carry(self, key: jax.Array) -> "RolloutCarry":
        """The rollout's carry at the start of an update: this state's envs, hidden state and window, and `key`."""
        return RolloutCarry(self.env_state, self.obs, self.hidden, key, self.window)

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


class Steps(NamedTuple):
    """What a rollout's scan stacks, one row per step: each [T, B, ...]."""

    transition: Transition
    info: StepInfo
    states: Any = None  # raw env states at each step's start (when asked for), else None


class Updates(NamedTuple):
    """What the training loop (`rl.loop.run_loop`) drives: `Trainer.updates` builds it."""

    dispatch: Callable[[Any], tuple[Any, Any]]  # state -> (state, metrics): device arrays, maybe still computing
    pipelined: bool  # dispatch returns before the update is computed: the next one may be dispatched first
    share_meter: Callable[[Callable[[], Any]], Any]  # (the state the next update starts from) -> rl.llm_share meter


def _row_shape(x) -> tuple | None:
    """(shape of one row, dtype) of a batched array (None stays None): a hashable stand-in for its shapes."""
    return None if x is None else (tuple(x.shape[1:]), jnp.dtype(x.dtype))


class Trainer:
    """Builds the env, network, optimizer and jitted update of a run from its `envs` and `ppo` sections.

    `encoder`: the run's `rl.encoder_kinds.Encoder` (`rl.encoder_kinds.load_encoder` loads one). The env batch is
    split over `devices` devices (a count, resolved: `rl.config.resolve_devices`): `self.mesh`; pass LLM arguments
    through `place_llm_args` once. `fusion`: how the policy reads the hidden state (`rl.networks`); `records`: the
    update also returns its rollout's samples (--save-trajectories); `speed`: how the programs are shaped (same
    results: `rl.config.SpeedConfig`). `Trainer.from_config` builds one from a whole `TrainConfig`.
    """

    def __init__(self, envs: EnvConfig, ppo: PPOConfig, encoder: Encoder, *, devices: int = 1, fusion: str = "norm",
                 records: bool = False, speed: SpeedConfig = SpeedConfig()):
        self.num_devices, self.seed, self.num_steps = devices, envs.seed, ppo.num_steps
        self.mesh = make_mesh(self.num_devices)
        self.local_envs = envs.num_envs // self.num_devices
        self.env = BatchedEnv(envs.env, envs.num_envs, envs.reset_ratio,
                              env_unroll=speed.env_unroll_for(encoder.uses_hidden), lazy_reset=speed.lazy_reset)
        self.rollout_unroll, self.batch_resets = speed.rollout_unroll, speed.batch_resets
        self.encoder = encoder
        self.llm = self.encoder.llm
        # XLA options of the outermost jits: the encoder kind's, then the run's own (--trainer-xla)
        self.compiler_options = {**self.encoder.compiler_options(), **speed.xla_options()}
        self.network = make_network(self.env.num_actions, augmented=self.encoder.uses_hidden, fusion=fusion,
                                    width=ppo.width)
        self.hp = PPOHyper(ppo.gamma, ppo.gae_lambda, ppo.clip_eps, ppo.ent_coef, ppo.vf_coef,
                           ppo.update_epochs, ppo.num_minibatches, ppo.shuffle)
        num_updates = ppo.total_timesteps // (envs.num_envs * ppo.num_steps)
        self.optimizer = make_optimizer(ppo.lr, num_updates * ppo.update_epochs * ppo.num_minibatches,
                                        anneal=ppo.anneal_lr, max_grad_norm=ppo.max_grad_norm, eps=ppo.adam_eps)
        window = self.encoder.window_specs
        self.runner_specs = RunnerState.specs(uses_hidden=self.encoder.uses_hidden, window=window)
        self.carry_specs = RolloutCarry.specs(uses_hidden=self.encoder.uses_hidden, window=window)
        rep, env, steps = P(), P(ENV_AXIS), P(None, ENV_AXIS)
        self.records = records  # the update also returns its rollout's samples
        recorded = RecordedRollout(steps, env, steps, steps, steps, steps)
        self.update = self.sharded(functools.partial(self._update, record=self.records), (self.runner_specs, rep),
                                   (self.runner_specs, rep, recorded) if self.records else (self.runner_specs, rep))
        self._reset = self.sharded(lambda key: self.env.reset(key, self.env_index()), rep, (env, env))
        self._init_learner = jax.jit(self._learner_init, static_argnums=(1, 2))
        self.parts = self._update_parts()
        self.encoder.attach(self.parts)
        self._run_update = self.encoder.make_update(self.parts)

    @classmethod
    def from_config(cls, cfg: TrainConfig, encoder=None, vllm_encoder=None) -> "Trainer":
        """The trainer of a whole `TrainConfig` (checked, and `--devices` resolved: 0 = all visible). `encoder`: an
        `rl.encoder_kinds.Encoder`, or an `rl.encoders.LLMSetup` (with the server's `rl.encoders.VLLMEncoder` as
        `vllm_encoder` for `vllm`) or nothing (`none`), which `make_encoder` turns into one."""
        cfg = resolve_devices(cfg)
        encoder = encoder if isinstance(encoder, Encoder) else make_encoder(cfg, encoder, vllm_encoder)
        return cls(cfg.envs, cfg.ppo, encoder, devices=cfg.devices, fusion=cfg.fusion,
                   records=cfg.save_trajectories is not None, speed=cfg.speed)

    # setup ------------------------------------------------------------------------------------
    def _update_parts(self) -> UpdateParts:
        """What the encoder builds with (`rl.update_parts`): the one value the trainer hands its encoder, so the
        encoder kinds never see the trainer."""
        return UpdateParts(mesh=self.mesh, env=self.env, sharded=self.sharded, env_index=self.env_index,
                           place_llm_args=self.place_llm_args, num_steps=self.num_steps, records=self.records,
                           runner_specs=self.runner_specs, carry_specs=self.carry_specs, run_window=self.run_window,
                           finish_update=self.finish_update, update=self.update,
                           update_from_clock=self.update_from_clock)

    def sharded(self, fn, in_specs, out_specs):
        """`fn` jitted as a shard_map over the env axis: per-env arguments (spec P(ENV_AXIS)) arrive as
        this device's rows, replicated ones (P()) whole. Replication is not type-checked (craftax's own
        scans are not written for it); every collective is explicit (`rl.ppo`, `episode_metrics`)."""
        return jit_with_options(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                              check_vma=False), compiler_options=self.compiler_options)

    def env_index(self) -> jax.Array:
        """Global indices of this device's envs (inside a shard_map; all envs on one device)."""
        return jax.lax.axis_index(ENV_AXIS) * self.local_envs + jnp.arange(self.local_envs)

    def apply(self, params, obs, hidden):
        return self.network.apply(params, obs, hidden)

    def place_llm_args(self, llm_args=LLMArgs()) -> LLMArgs:
        """The LLM params and prefix cache, replicated over the mesh (a no-op for `LLMArgs()`)."""
        return jax.device_put(LLMArgs(*llm_args), replicated(self.mesh))

    def llm_arg_shapes(self, llm_args=LLMArgs()) -> LLMArgs:
        """`place_llm_args(llm_args)` as `jax.ShapeDtypeStruct`s with its shardings (`llm_args` may be shapes
        already, e.g. before the weights are loaded: `rl.encoder_kinds.Encoder.load_shapes`)."""
        sharding = replicated(self.mesh)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), LLMArgs(*llm_args))

    def compile_start(self, llm_args=LLMArgs(), on_lowered: Callable[[], None] = lambda: None) -> Any:
        """Compile the program `init_state(llm_args)` runs the LLM in (the encoder's first window:
        `Encoder.compile_start`) for `llm_args`' shapes (`llm_arg_shapes`: the weights may still be loading);
        `init_state` then finds it compiled. Returns its executable (None where the encoder runs no such program).
        `on_lowered()` is called once it is traced and lowered, before XLA compiles it (or when that fails). The env
        reset that `init_state` runs first compiles on its own: `compile_reset`."""
        try:
            _, _, k_env = self._init_keys()
            env = NamedSharding(self.mesh, P(ENV_AXIS))
            _, env_state = jax.eval_shape(self._reset, k_env)
            env_state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=env), env_state)
            return self.encoder.compile_start(self.parts, self.llm_arg_shapes(llm_args), env_state, k_env,
                                              on_lowered=on_lowered)
        finally:
            on_lowered()  # (maybe again: harmless) a thread waiting for it never waits for a compile that failed

    def compile_reset(self) -> Any:
        """Compile the env reset that `init_state` runs first (seconds on a GPU: Craftax's world generation); returns
        its executable."""
        from jaxllm.compile import compile_ahead

        return compile_ahead(self._reset, self._init_keys()[2])

    def place(self, runner: RunnerState) -> RunnerState:
        """`runner` with its per-env fields split over the mesh and the rest replicated."""
        return jax.device_put(runner, runner.shardings(self.mesh))

    def _init_keys(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(runner key, network init key, env reset key) that `init_state` draws from the seed."""
        return tuple(jax.random.split(jax.random.PRNGKey(self.seed), 3))

    def init_state(self, llm_args=LLMArgs(), shapes_only: bool = False) -> RunnerState:
        """Initial params, optimizer state, envs and (for LLM encoders) the first hidden states,
        placed on the mesh. The values do not depend on the device count. `shapes_only`: for tracing under
        `jax.eval_shape` (`runner_shapes`), the first hidden states' values are left out (`Encoder.start_shapes`)."""
        key, k_net, k_env = self._init_keys()
        obs, env_state = self._reset(k_env)
        start = self.encoder.start_shapes if shapes_only else self.encoder.start
        hidden, window = start(self.parts, llm_args, env_state, k_env)
        params, opt_state = self._init_learner(k_net, _row_shape(obs), _row_shape(hidden))
        return self.place(RunnerState(params, opt_state, env_state, obs, hidden, key, jnp.zeros((), jnp.int32),
                                      window))

    def _learner_init(self, key, obs_row: tuple | None, hidden_row: tuple | None) -> tuple[Any, Any]:
        """(network params, optimizer state) for one env's observation and hidden state, given as (shape, dtype)
        (`_row_shape`): init reads only shapes, so zeros stand in (with several processes the envs' values are not
        all on this host). Jitted as one program (`_init_learner`): run eagerly, each of its few dozen operations
        compiled on its own, 0.5 s apiece on a GPU."""
        dummy_h = None if hidden_row is None else jnp.zeros((1,) + hidden_row[0], hidden_row[1])
        params = self.network.init(key, jnp.zeros((1,) + obs_row[0], obs_row[1]), dummy_h)
        return params, self.optimizer.init(params)

    def runner_shapes(self, llm_args=LLMArgs()) -> RunnerState:
        """The runner `init_state(llm_args)` returns, as `jax.ShapeDtypeStruct`s with its shardings: traced, nothing
        runs (what compiling the update ahead needs); the LLM's first call is not traced (`Encoder.start_shapes`)."""
        shapes = jax.eval_shape(functools.partial(self.init_state, shapes_only=True), llm_args)
        return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                            shapes, shapes.shardings(self.mesh))

    @property
    def runs_update(self) -> bool:
        """Whether a training update is the one jitted `update` (every kind whose LLM, if any, runs in the scan); the
        HTTP kind runs a host loop of windows instead."""
        return self._run_update is self.update

    def compile_update(self, llm_args=LLMArgs(), on_lowered: Callable[[], None] = lambda: None) -> Any:
        """Compile the update now for the runner `init_state(llm_args)` returns (`jaxllm.compile.compile_ahead`; XLA
        releases the GIL, so a thread can run this while the main thread sets the run up). The update's later calls
        on such a runner find it compiled (jax's own cache of the jitted function); returns the executable.
        `on_lowered()` is called once it is traced and lowered, before XLA compiles it (or when that fails)."""
        from jaxllm.compile import compile_ahead

        try:
            return compile_ahead(self.update, self.runner_shapes(llm_args), LLMArgs(*llm_args),
                                 on_lowered=on_lowered)
        finally:
            on_lowered()  # (maybe again: harmless) a thread waiting for it never waits for a compile that failed

    # rollout ----------------------------------------------------------------------------------
    def _act(self, params, carry: RolloutCarry, env_index, llm_args: LLMArgs | None = None, fresh=None):
        """One env+policy step. With `llm_args` the encoder's window advances (in-scan: its clock ticks, and the
        step that ends a window encodes the new states). `fresh`: this step's fresh worlds drawn before the scan
        (`batch_resets`; the same worlds the step would draw), else None."""
        key, k_act, k_env = jax.random.split(carry.key, 3)
        pi, value = self.apply(params, carry.obs, carry.hidden)
        action = jax.vmap(jax.random.categorical)(keys_per_index(k_act, env_index), pi.logits)
        log_prob = pi.log_prob(action)
        window = carry.window
        pool = window.pool if window is not None else fresh
        next_obs, next_state, reward, done, info = self.env.step(k_env, carry.env_state, action, env_index, pool)
        hidden = self.encoder.reset_reads(carry.hidden, window, done, lambda: self.env.block_slots(env_index))
        if llm_args is not None:
            hidden, window = self.encoder.advance(llm_args, hidden, window, next_state, k_env, env_index, self.env)
        tr = Transition(carry.obs, carry.hidden, action, log_prob, value, reward, done)
        return RolloutCarry(next_state, next_obs, hidden, key, window), Steps(tr, info, carry.env_state.env_state)

    def run_window(self, params, carry: RolloutCarry, length: int, keep_states: bool = False, env_index=None,
                   llm_args: LLMArgs | None = None) -> tuple[RolloutCarry, Steps]:
        """`length` env+policy steps -> (carry, Steps: Transition [T, B], StepInfo [T, B], raw env states [T, B]
        or None). Without `llm_args` the hidden state is held (reset envs per `carry.window`, zeros without one);
        with them the encoder's windows run as in training. `env_index`: global indices of the envs in
        `carry` (default: 0..B-1, the whole batch on one device). Done envs restart (`BatchedEnv.step`)."""
        if env_index is None:
            env_index = jnp.arange(carry.obs.shape[0])
        fresh = self.fresh_worlds(carry.key, length, env_index) if self.batch_resets and carry.window is None else None
        carry, steps = jax.lax.scan(lambda c, f: self._act(params, c, env_index, llm_args, f), carry, fresh, length,
                                    unroll=max(1, min(self.rollout_unroll, length)))
        return carry, steps if keep_states else steps._replace(states=None)

    def play_carry(self, obs: jax.Array, env_state: EnvBatchState, key: jax.Array) -> RolloutCarry:
        """The carry a play on `run_window` starts from (`rl.play.trainer_start`): these envs, no hidden state yet
        and no LLM window (the play's first window opens them: `open_play_window`)."""
        return RolloutCarry(env_state, obs, None, key)

    def fresh_worlds(self, key: jax.Array, length: int, env_index: jax.Array):
        """The fresh worlds (`BatchedEnv.reset_pool`) that `length` steps from rollout key `key` draw, one step after
        another, drawn in one batched call: (obs [T, W, O], raw states [T, W]). Their keys follow `_act`'s key chain
        (key -> next key, action key, env key; the env key's second half resets), which does not depend on the data."""
        def next_key(k, _):
            k_next, _, k_env = jax.random.split(k, 3)
            return k_next, jax.random.split(k_env)[1]

        _, reset_keys = jax.lax.scan(next_key, key, None, length)
        return jax.vmap(lambda k: self.env.reset_pool(k, env_index))(reset_keys)

    def open_play_window(self, carry: RolloutCarry, hidden_of: Callable, key: jax.Array) -> RolloutCarry:
        """`carry` at a play's window start (`rl.play.trainer_window`): the hidden state `hidden_of(raw_states)`
        reads of its envs and what a reset env reads until the next window, by the run's reset rule
        (`Encoder.play_window`: with "pool", a reset pool drawn with `key` and read in the same call; else zeros),
        as `run_window` applies it in training."""
        env_index = jnp.arange(carry.obs.shape[0])
        hidden, window = self.encoder.play_window(hidden_of, carry.env_state, key, env_index, self.env)
        return carry._replace(hidden=hidden, window=window)

    def rollout(self, params, carry: RolloutCarry, llm_args: LLMArgs, keep_states: bool = False, env_index=None):
        """One rollout of num_steps steps from `carry` -> (RolloutCarry, Transition [T, B], StepInfo [T, B],
        states or None). In-scan, `carry.window` (the runner's) says where the current LLM window stands.

        Runs on one device's envs inside the update's shard_map (`env_index`: their global indices), or on
        all envs when called directly. `keep_states=True` also returns every step's raw env state (for tests).
        """
        carry, steps = self.run_window(params, carry, self.num_steps, keep_states, env_index, LLMArgs(*llm_args))
        return carry, steps.transition, steps.info, steps.states

    # update -----------------------------------------------------------------------------------
    def finish_update(self, runner: RunnerState, carry: RolloutCarry, key_ppo, traj: Transition, info: StepInfo):
        """PPO on this device's rollout (losses and gradients averaged over all devices) -> (runner, metrics).
        `carry.key` becomes the runner's next key."""
        _, last_value = self.apply(runner.params, carry.obs, carry.hidden)
        params, opt_state, losses = ppo_update(runner.params, runner.opt_state, self.optimizer, self.apply,
                                               traj, last_value, key_ppo, self.hp, axis_name=ENV_AXIS,
                                               env_index=self.env_index())
        metrics = dict(losses, **episode_metrics(info, ENV_AXIS))
        if traj.hidden is not None:
            metrics["hidden_zero_frac"] = jax.lax.pmean(jnp.mean(jnp.all(traj.hidden == 0, axis=-1)), ENV_AXIS)
        return RunnerState(params, opt_state, carry.env_state, carry.obs, carry.hidden, carry.key,
                           runner.update + 1, carry.window), metrics

    def _update(self, runner: RunnerState, llm_args: LLMArgs, record: bool = False):
        """One full training update (rollout + PPO) as a pure function; jitted as `self.update`. With `record`
        it also returns the rollout's samples (`RecordedRollout`)."""
        key, k_roll, k_ppo = jax.random.split(runner.rng, 3)
        start = runner.rollout_carry(k_roll)
        carry, traj, info, _ = self.rollout(runner.params, start, llm_args, env_index=self.env_index())
        runner, metrics = self.finish_update(runner, carry._replace(key=key), k_ppo, traj, info)
        if not record:
            return runner, metrics
        return runner, metrics, recorded_rollout(traj, runner.obs)

    def dispatch(self, runner: RunnerState, llm_args=LLMArgs(), on_rollout: Callable | None = None):
        """Start one update; returns (runner, metrics) as device arrays that are still being computed (nothing
        waits for them; `on_rollout` as in `step`), except where the encoder runs the update on the host
        (`Encoder.pipelined` False), which runs it through."""
        runner, metrics, *samples = self._run_update(runner, LLMArgs(*llm_args))
        if on_rollout is not None and samples and samples[0] is not None:
            on_rollout(samples[0])
        return runner, metrics

    def updates(self, llm_args=LLMArgs(), on_rollout: Callable | None = None) -> Updates:
        """What the training loop (`rl.loop.run_loop`) drives: `dispatch` with these LLM arguments (placed:
        `place_llm_args`) and `on_rollout`, whether it is pipelined, and the encoder's LLM time-share meter."""
        return Updates(functools.partial(self.dispatch, llm_args=llm_args, on_rollout=on_rollout),
                       self.encoder.pipelined, functools.partial(self.encoder.share_meter, self.parts, llm_args))

    def step(self, runner: RunnerState, llm_args=LLMArgs(), on_rollout: Callable | None = None):
        """Advance one update; returns (runner, metrics as numpy).

        on_rollout (with `records`): called with the rollout's `RecordedRollout` of device arrays
        (obs [T, B, O], the observation after its last step [B, O], action, reward, done, log_prob [T, B]) before
        the metrics are fetched, e.g. `rl.trajectories.TrajectoryWriter.add_rollout`, which copies them while the
        next update runs.
        """
        runner, metrics = self.dispatch(runner, llm_args, on_rollout)
        return runner, jax.device_get(metrics)

    def update_from_clock(self, runner: RunnerState, llm_args: LLMArgs, clock: int):
        """One update from `runner` with its LLM window clock set to `clock` (num_steps + 1: no window opens; 1: one at
        the first step, then every skip_n), for timing the in-scan LLM (rl.llm_share); the outputs are to be thrown
        away. None when the runner carries no LLM window."""
        if runner.window is None:
            return None
        at = jax.device_put(jnp.asarray(clock, jnp.int32), runner.window.clock.sharding)
        return self.update(runner._replace(window=runner.window._replace(clock=at)), LLMArgs(*llm_args))


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

"""Where the policy's hidden state comes from, as a type: one `Encoder` per `--encoder` kind.

    NoEncoder      --encoder none    plain PPO: the policy reads no hidden state
    InScanEncoder  --encoder inscan  the JAX LLM inside the jitted rollout, one window of skip_n steps at a time
    HTTPEncoder    --encoder vllm    an embedding server, asked on the host between windows of skip_n steps

`load_encoder` (or `make_encoder`, from parts already loaded) picks the kind once, from the run's `HiddenConfig` and
`LLMConfig` sections; the trainer (`rl.trainer.Trainer`), `rl.train` and its loop (`rl.loop`) then call this
interface only and never ask which kind they hold:

    how a window opens     `start` (the run's first hidden state), `advance` (each step, inside the scan)
    what the policy reads  the hidden state that `start` / `advance` return, held in the rollout carry
    what a reset reads     `reset_reads` (an env that finished an episode inside a window)
    what a play reads      `play_window` (a play's window start, rl.play: the run's reset rule, its own source)
    how an update runs     `make_update` (one jitted function, or the HTTP host loop over windows)
    what it costs          `share_meter` (the share of an update's time spent in the LLM, rl.llm_share)
    what it is             `describe` (one line for the run's output), `preflight` (refuse what cannot run)

The jit-side methods (`reset_reads`, `advance`) are pure functions of their arguments; the host-side ones take
the `rl.update_parts.UpdateParts` of the trainer they serve (its mesh, env, sharded jits, the pieces of an update):
the trainer imports this module and hands those parts over; nothing here knows the trainer itself.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.compile import compiler_options
from rl.config import HiddenConfig, LLMConfig
from rl.encoders import VLLMEncoder, make_token_fn
from rl.llm import LLMArgs, LLMSetup, llm_shapes, load_llm, load_weights, make_llm_encoder
from rl.play import zero_on_reset
from rl.sharding import ENV_AXIS, from_process_local_rows, process_local_rows
from rl.trajectories import RecordedRollout
from rl.update_parts import UpdateParts

Update = Callable[[Any, LLMArgs], tuple]  # (runner, llm_args) -> (runner, metrics[, RecordedRollout or None])


class LLMWindow(NamedTuple):
    """The in-scan LLM's window, carried from step to step and rollout to rollout (checkpointed)."""

    clock: jax.Array  # int32 scalar: steps left in the current window (unused with skip_n 0)
    pool: tuple[jax.Array, Any] | None  # (obs [W, O], raw states [W]): one fresh world per reset block ("pool")
    pool_hidden: jax.Array | None  # [W, D]: their hidden states, encoded with the window's envs

    @staticmethod
    def specs(pooled: bool) -> "LLMWindow":
        env = P(ENV_AXIS)
        return LLMWindow(P(), (env, env) if pooled else None, env if pooled else None)


class Encoder:
    """The interface (and the behaviour every kind shares: no window, a reset env reads zeros).

    `hidden`, `settings`: the run's `HiddenConfig` and `LLMConfig` sections. `llm`: the host-side LLM objects
    (`rl.encoders.LLMSetup`), None without an LLM. `pipelined`: an update is one jitted call that returns before it
    is computed, so the loop may dispatch the next one first."""

    uses_hidden = True
    pipelined = True

    def __init__(self, hidden: HiddenConfig, settings: LLMConfig, llm: LLMSetup | None = None):
        self.hidden, self.settings, self.llm = hidden, settings, llm

    def compiler_options(self) -> dict[str, Any]:
        """XLA options for the trainer's outermost jits: XLA's defaults where no LLM runs inside them
        (`jaxllm.compile`: Triton GEMMs stay on for plain PPO, measured faster)."""
        return compiler_options(runs_llm=False)

    @classmethod
    def load(cls, hidden: HiddenConfig, settings: LLMConfig, env: str) -> "Encoder":
        """Load what this kind encodes with for game `env` (model, tokenizer, template, a server's client) and
        return the encoder."""
        return cls.build(hidden, settings, None, None)

    @classmethod
    def build(cls, hidden: HiddenConfig, settings: LLMConfig, llm: LLMSetup | None,
              client: VLLMEncoder | None) -> "Encoder":
        """An encoder of this kind from the loaded parts it needs (ValueError naming what is missing)."""
        raise NotImplementedError

    loads_weights_later = False  # `load_shapes` leaves weights to `load_weights` (the in-scan LLM's)
    weights_pending = False  # weights are still shapes (`load_shapes`, before `load_weights`)

    @classmethod
    def load_shapes(cls, hidden: HiddenConfig, settings: LLMConfig, env: str) -> "Encoder":
        """`load`, except that weights this kind reads through jitted arguments (`jit_args`) stay shapes
        (`jax.ShapeDtypeStruct`s) until `load_weights`: enough to build the trainer and compile its programs ahead
        while the weights load. Here (nothing to leave for later): `load`."""
        return cls.load(hidden, settings, env)

    def load_weights(self) -> None:
        """Load what `load_shapes` left as shapes (a no-op once loaded, and for kinds that leave nothing)."""

    def compile_start(self, parts: UpdateParts, llm_args: LLMArgs, env_state, key,
                      on_lowered: Callable[[], None] = lambda: None) -> Any:
        """Compile the program `start` runs for these arguments (shapes will do) now, so that `start` finds it
        compiled, calling `on_lowered()` once it is traced (`jaxllm.compile.compile_ahead`); None where `start` runs
        no program of its own (here: `on_lowered()` at once)."""
        on_lowered()
        return None

    @classmethod
    def preflight(cls, hidden: HiddenConfig, settings: LLMConfig) -> None:
        """Refuse (ValueError / ConnectionError, one line) what cannot run, before a run directory is touched."""

    def describe(self) -> str | None:
        """One line about the LLM the run reads (None without one)."""
        return None

    # what the trainer carries ---------------------------------------------------------------
    window_specs: LLMWindow | None = None  # PartitionSpecs of the `LLMWindow` the runner state carries (None: none)

    def jit_args(self) -> LLMArgs:
        """The LLM arrays every jitted call takes as arguments (empty without an in-scan LLM)."""
        return LLMArgs()

    def attach(self, parts: UpdateParts) -> None:
        """Build this kind's jitted helpers on the trainer's mesh (`parts.sharded`; called once by the trainer it
        serves)."""

    # jit side (pure) --------------------------------------------------------------------------
    def reset_reads(self, hidden, window: LLMWindow | None, done, block_slots: Callable) -> jax.Array | None:
        """The hidden state [B, D] after a step whose `done` [B] envs start a new episode: a new episode never
        sees its predecessor's vector. Here: zeros ("no LLM reading yet")."""
        return zero_on_reset(hidden, done)

    def advance(self, llm_args: LLMArgs, hidden, window, next_state, k_env, env_index, env) -> tuple:
        """(hidden, window) after one step of the rollout's scan (the window's clock). Here: unchanged."""
        return hidden, window

    def play_window(self, hidden_of: Callable, env_state, key, env_index, env) -> tuple:
        """(hidden [B, D], window or None) a play's window starts with on `env_state` (`rl.play.trainer_window`),
        the reset rule as in training: `hidden_of(raw_states [N]) -> [N, D]` is the play's source (the run's
        encoder, maybe ablated or behind another prompt), `key` draws a reset pool where the run pools. Here: the
        envs' hidden states and no window (a reset env reads zeros)."""
        return hidden_of(env_state.env_state), None

    # host side --------------------------------------------------------------------------------
    def start(self, parts: UpdateParts, llm_args: LLMArgs, env_state, key) -> tuple:
        """(hidden [B, D] or None, window or None) that the run's first step reads (the first window opens)."""
        return None, None

    def start_shapes(self, parts: UpdateParts, llm_args: LLMArgs, env_state, key) -> tuple:
        """`start`'s result for tracing its shapes only (`Trainer.runner_shapes`, under `jax.eval_shape`): the same
        shapes and dtypes, its values meaningless; a kind may skip tracing its LLM here. Here: `start`."""
        return self.start(parts, llm_args, env_state, key)

    def make_update(self, parts: UpdateParts) -> Update:
        """The function that runs one training update: by default the trainer's single jitted update
        (`parts.update`)."""
        return parts.update

    def share_meter(self, parts: UpdateParts, llm_args: LLMArgs, current_state: Callable[[], Any]):
        """What measures the share of an update's time spent in the LLM (`rl.llm_share`: `due(k)`, `measure()`,
        `value_for(update_seconds)`); `current_state()` gives the state the next update starts from. Here: 0."""
        from rl.llm_share import FixedShare

        return FixedShare()


class NoEncoder(Encoder):
    """`--encoder none`: plain PPO on the symbolic observation."""

    uses_hidden = False

    @classmethod
    def build(cls, hidden, settings, llm, client) -> "NoEncoder":
        return cls(hidden, settings)


class InScanEncoder(Encoder):
    """`--encoder inscan`: the JAX LLM inside the jitted update. A window of skip_n steps opens by encoding the envs'
    states (and, with the "pool" reset policy, one fresh world per reset block in the same LLM call); its clock
    ticks every step and the step that ends it opens the next (`lax.cond`: no LLM work on other steps)."""

    @classmethod
    def load(cls, hidden, settings, env):
        return cls(hidden, settings, load_llm(settings, env=env))

    loads_weights_later = True

    @classmethod
    def load_shapes(cls, hidden, settings, env):
        """The tokenizer and template loaded, the model's params and the prompt head's cache as shapes
        (`rl.llm.llm_shapes`) until `load_weights`."""
        return cls(hidden, settings, llm_shapes(settings, env=env))

    def load_weights(self) -> None:
        """The model's weights and the prompt head's cache (`rl.llm.load_weights`), unless loaded: the template and
        the model's config stay the same objects, so the programs built on them (`encode`, `attach`) stay valid."""
        if self.weights_pending:
            self.llm = load_weights(self.settings, self.llm)

    @property
    def weights_pending(self) -> bool:
        """Whether the params are still `jax.ShapeDtypeStruct`s (`load_shapes`, before `load_weights`)."""
        return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(self.llm.jit_args))

    def compile_start(self, parts, llm_args, env_state, key, on_lowered=lambda: None):
        """`start`'s window-opening LLM call (`open_window`), compiled for `llm_args` placed as
        `parts.place_llm_args` places them (shapes with their shardings will do) and `env_state`'s shapes."""
        from jaxllm.compile import compile_ahead

        return compile_ahead(self.open_window, llm_args, env_state, jax.random.fold_in(key, 1),
                             on_lowered=on_lowered)

    @classmethod
    def build(cls, hidden, settings, llm, client) -> "InScanEncoder":
        if llm is None:
            raise ValueError(f"--encoder {hidden.encoder} needs an LLM setup (rl.encoders.load_llm)")
        return cls(hidden, settings, llm)

    def __init__(self, hidden: HiddenConfig, settings: LLMConfig, llm: LLMSetup):
        super().__init__(hidden, settings, llm)
        self.skip_n, self.pooled = hidden.skip_n, hidden.on_reset == "pool"
        self.encode = make_llm_encoder(settings, llm)
        self.window_specs = LLMWindow.specs(pooled=self.pooled)
        self.open_window = self.encode_states = None  # sharded over the trainer's mesh by `attach`
        self.open_window_shapes = None

    def compiler_options(self) -> dict[str, Any]:
        """The LLM runs inside the update: on a GPU, Triton GEMMs off (`jaxllm.compile`; fp8 compiles in seconds)."""
        return compiler_options(runs_llm=True)

    @classmethod
    def preflight(cls, hidden, settings) -> None:
        if settings.template_assembly == "pallas" and jax.default_backend() != "gpu":
            raise ValueError(f"--template-assembly pallas needs a GPU (on {jax.default_backend()} Pallas's "
                             f"interpreter would run it, which fails inside the trainer's shard_map); use auto or jnp")

    def jit_args(self) -> LLMArgs:
        return self.llm.jit_args

    def describe(self) -> str:
        model, s = self.llm.model, self.settings
        n = sum(int(getattr(x, "size", 0)) for x in jax.tree.leaves(model.params))  # fp8 leaves count once
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        dtype = s.llm_dtype if s.llm_dtype == "fp8" else getattr(model.dtype, "__name__", str(model.dtype))
        return (f"LLM: {s.model} ({size} parameters, {dtype}, hidden size {self.llm.hidden_size}); prompt head "
                f"{len(self.llm.template.prefix_ids)} tokens (cached once), re-encoded every {self.skip_n} steps")

    def attach(self, parts: UpdateParts) -> None:
        rep, env = P(), P(ENV_AXIS)
        self.encode_states = parts.sharded(self.encode, (rep, rep, env), env)
        open_window = lambda args, es, key: self.open(LLMArgs(*args), es, key, parts.env_index(), parts.env)
        self.open_window = parts.sharded(open_window, (rep, env, rep), (env, self.window_specs))
        # the same window with zeros for the LLM's vectors: its own function (jax caches a trace per function, so
        # the real `open_window` never meets this one's), for `start_shapes`
        shapes = lambda args, es, key: self.open_with(self._hidden_zeros, es, key, parts.env_index(), parts.env)
        self.open_window_shapes = parts.sharded(shapes, (rep, env, rep), (env, self.window_specs))

    def _hidden_zeros(self, raw_states) -> jax.Array:
        """Zeros of the encoder's output for raw_states [N]: float32 [N, hidden size] (`make_inscan_encoder`)."""
        return jnp.zeros((jax.tree.leaves(raw_states)[0].shape[0], self.llm.hidden_size), jnp.float32)

    def open(self, llm_args: LLMArgs, env_state, key, env_index, env) -> tuple:
        """A window starts on `env_state`: the envs' hidden states [B, D] and the new `LLMWindow` (clock =
        skip_n; with the "pool" reset policy, one fresh world per reset block drawn with `key`, encoded in the
        same LLM call as the envs: `open_with`)."""
        return self.open_with(lambda raw: self.encode(*llm_args, raw), env_state, key, env_index, env)

    def open_with(self, hidden_of: Callable, env_state, key, env_index, env) -> tuple:
        """`open` with the hidden states read by `hidden_of(raw_states [N]) -> [N, D]` (training: the run's
        encoder; a play: maybe ablated). Pooled, it reads the envs and their pool worlds in one call."""
        clock = jnp.asarray(self.skip_n, jnp.int32)
        raw = env_state.env_state
        if not self.pooled:
            return hidden_of(raw), LLMWindow(clock, None, None)
        pool = env.reset_pool(key, env_index)
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), raw, pool[1])
        hidden = hidden_of(both)
        batch = env_index.shape[0]
        return hidden[:batch], LLMWindow(clock, pool, hidden[batch:])

    def play_window(self, hidden_of, env_state, key, env_index, env):
        """Pooled: the window's `LLMWindow` with a reset pool drawn with `key` (`open_with`: the envs and one
        world per reset block in one `hidden_of` call, so an ablation treats them as one batch); a reset env
        restarts in its block's pool world and reads its hidden state, as in training. Else the base rule
        (no window, zeros)."""
        if not self.pooled:
            return super().play_window(hidden_of, env_state, key, env_index, env)
        return self.open_with(hidden_of, env_state, key, env_index, env)

    def reset_reads(self, hidden, window, done, block_slots):
        """A reset env reads its pool world's hidden state ("pool"), else zeros."""
        pool = window.pool if window is not None else None
        if hidden is None or pool is None:
            return super().reset_reads(hidden, window, done, block_slots)
        return jnp.where(done[:, None], window.pool_hidden[block_slots()], hidden)

    def advance(self, llm_args, hidden, window, next_state, k_env, env_index, env):
        if window is None or self.skip_n == 0:
            return hidden, window
        window = window._replace(clock=window.clock - 1)
        k_pool = jax.random.split(k_env)[1]  # the step's own reset key, unused when the pool resets

        def new_window(hidden, window):
            return self.open(llm_args, next_state, k_pool, env_index, env)

        return jax.lax.cond(window.clock == 0, new_window, lambda h, w: (h, w), hidden, window)

    def start(self, parts, llm_args, env_state, key):
        return self.open_window(parts.place_llm_args(llm_args), env_state, jax.random.fold_in(key, 1))

    def start_shapes(self, parts, llm_args, env_state, key):
        """`start` without tracing the LLM and its template (~3 s at the 4B shape, on a start's critical path): the
        window opens on zeros of the encoder's output shape (`tests/test_rl_inscan.py` checks the shapes equal
        `start`'s)."""
        return self.open_window_shapes(parts.place_llm_args(llm_args), env_state, jax.random.fold_in(key, 1))

    def share_meter(self, parts, llm_args, current_state):
        """Two throwaway updates timed back to back, without and with LLM windows (`rl.llm_share.LLMShare`)."""
        from rl.llm_share import LLMShare

        return LLMShare(lambda clock: parts.update_from_clock(current_state(), llm_args, clock),
                        parts.num_steps, self.skip_n)


class HTTPEncoder(Encoder):
    """`--encoder vllm`: an embedding server speaking vLLM's API. An update runs on the host: a jitted window of
    skip_n steps (the hidden state held, a reset env reads zeros), the server encodes the envs' new states, and
    so on for num_steps / skip_n windows; then the PPO step runs in its own jitted call."""

    pipelined = False

    @classmethod
    def load(cls, hidden, settings, env):
        llm = load_llm(settings, env=env, with_model=False)
        return cls(hidden, settings, llm, VLLMEncoder(hidden.vllm_url, llm.template, timeout=hidden.vllm_timeout))

    @classmethod
    def build(cls, hidden, settings, llm, client) -> "HTTPEncoder":
        if llm is None:
            raise ValueError(f"--encoder {hidden.encoder} needs an LLM setup (rl.encoders.load_llm)")
        if client is None:
            raise ValueError("--encoder vllm needs the server's client (rl.encoders.VLLMEncoder)")
        return cls(hidden, settings, llm, client)

    def __init__(self, hidden: HiddenConfig, settings: LLMConfig, llm: LLMSetup, client: VLLMEncoder):
        super().__init__(hidden, settings, llm)
        self.client, self.skip_n = client, hidden.skip_n
        self._last_seconds = 0.0  # the server's time during the latest update
        self._tokens = None

    @classmethod
    def preflight(cls, hidden, settings) -> None:
        from rl.encoders import check_vllm_reachable

        check_vllm_reachable(hidden.vllm_url, hidden.vllm_timeout)

    def describe(self) -> str:
        return (f"LLM: {self.settings.model} on the embedding server {self.hidden.vllm_url}; prompt head "
                f"{len(self.llm.template.prefix_ids)} tokens")

    def attach(self, parts: UpdateParts) -> None:
        env = P(ENV_AXIS)
        self._tokens = parts.sharded(make_token_fn(self.llm.template), env, (env, env))

    def hidden_of(self, parts: UpdateParts, env_state) -> jax.Array:
        """Hidden states from the server, placed split over the mesh like every per-env array.
        Each process sends only its own envs' prompts (all of them when there is one process)."""
        ids, lengths = (process_local_rows(x) for x in self._tokens(env_state.env_state))
        return from_process_local_rows(self.client(ids, lengths), parts.mesh, parts.env.num_envs)

    def start(self, parts, llm_args, env_state, key):
        return self.hidden_of(parts, env_state), None

    def advance(self, llm_args, hidden, window, next_state, k_env, env_index, env):
        raise RuntimeError("the vllm encoder rolls out on the host; use Trainer.step")

    def make_update(self, parts: UpdateParts) -> Update:
        skip_n, windows = self.skip_n, parts.num_steps // self.skip_n
        rep, steps = P(), P(None, ENV_AXIS)
        specs, carry_specs = parts.runner_specs, parts.carry_specs
        run_window = parts.sharded(lambda p, c: parts.run_window(p, c, skip_n, env_index=parts.env_index()),
                                   (rep, carry_specs), (carry_specs, steps))
        finish = parts.sharded(lambda runner, c, k, chunks: parts.finish_update(runner, c, k, *concat_steps(chunks)),
                               (specs, carry_specs, rep, steps), (specs, rep))

        def update(runner, llm_args):
            t0 = self.client.seconds
            key, k_roll, k_ppo = jax.random.split(runner.rng, 3)
            carry = runner.rollout_carry(k_roll)
            chunks = []
            for _ in range(windows):
                carry, out = run_window(runner.params, carry)
                chunks.append((out.transition, out.info))
                carry = carry._replace(hidden=self.hidden_of(parts, carry.env_state))
            runner, metrics = finish(runner, carry._replace(key=key), k_ppo, chunks)
            self._last_seconds = self.client.seconds - t0
            samples = recorded_rollout(concat_steps([tr for tr, _ in chunks]), runner.obs) if parts.records else None
            return runner, metrics, samples

        return update

    def share_meter(self, parts, llm_args, current_state):
        """The server's seconds during the latest update over the update's seconds."""
        from rl.llm_share import ServerShare

        return ServerShare(lambda: self._last_seconds)


def concat_steps(chunks):
    """Windows' pytrees of [T, B, ...] arrays joined along the time axis."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *chunks)


def recorded_rollout(traj, last_obs: jax.Array) -> RecordedRollout:
    """The samples of a rollout (`rl.ppo.Transition` [T, B]) that `--save-trajectories` keeps."""
    return RecordedRollout(traj.obs, last_obs, traj.action, traj.reward, traj.done, traj.log_prob)


KINDS: dict[str, type[Encoder]] = {"none": NoEncoder, "inscan": InScanEncoder, "vllm": HTTPEncoder}


def kind_of(hidden: HiddenConfig) -> type[Encoder]:
    """The `Encoder` type of `hidden.encoder` (for its `preflight` before anything is loaded)."""
    return KINDS[hidden.encoder]


def load_encoder(hidden: HiddenConfig, settings: LLMConfig, env: str, *, weights: bool = True) -> Encoder:
    """The encoder of a run's `hidden` and LLM `settings` sections for game `env`, with what it encodes with loaded
    (the model, template and prefix cache in-scan; the tokenizer, template and a client of the server for HTTP):
    the one place that turns the `--encoder` name into behaviour. `weights` False: the in-scan model's weights
    stay shapes until the encoder's `load_weights` (`Encoder.load_shapes`)."""
    kind = kind_of(hidden)
    return kind.load(hidden, settings, env) if weights else kind.load_shapes(hidden, settings, env)


def make_encoder(cfg: Any, llm: LLMSetup | None = None, client: VLLMEncoder | None = None) -> Encoder:
    """The encoder of a `TrainConfig` from already loaded parts (`rl.encoders.load_llm`, a `VLLMEncoder`)."""
    return kind_of(cfg.hidden).build(cfg.hidden, cfg.llm, llm, client)

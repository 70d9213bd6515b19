"""Playing episodes with a trained policy: THE play loop of rl.eval, rl.video, the probe's base states
(rl.probe.states) and rl.offline eval.

A play is a host loop of jitted windows (`play_windows`). One window (`play_window`) is three steps, each written
once here:

1. the hidden-state source refreshes the policy's hidden state from the window's first states
   (`refresh_hidden`: every window, so a window of skip_n steps is the run's refresh cadence; with an ablation mode,
   through `rl.modes.ablate`);
2. `length` env+policy steps with the hidden state held, a reset env reading what the run's reset rule says: a
   tool's `steps(carry, length) -> (carry, out)`, either the trainer's own window scan (`Trainer.run_window`: eval
   and video play exactly as in training, the refresh opening the run's window through
   `Trainer.open_play_window`: with `--reset-hidden pool` one fresh world per reset block is read with the envs and
   a reset env restarts in it and reads its hidden state; with "zero" a reset env reads zeros) or `sampled_steps`
   (a policy without a trainer: the probe; a reset env reads zeros, `zero_on_reset`, whatever the run's rule);
3. the window folded into what the play keeps (`fold`; by default each env's first episode, `first_episodes`).

Every env plays one episode from a fresh world and only that first episode counts (short episodes are not
over-counted); `play_windows` runs the windows until every env finished or `max_steps`. rl.offline eval refreshes
each env on its own clock inside its steps (`steps`, no `refresh`); the rest is the same loop.

The trainer's rollout (`rl.trainer.Trainer.rollout`) keeps its own scan: it is the program being timed, its LLM
windows run inside the scan (`lax.cond` on a clock that carries across rollouts, reset pools) and its shard_map
splits envs over devices; the play loop calls into it (`Trainer.run_window`) rather than the other way round.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.compile import jit as jit_with_options
from rl.jit import compile_program
from rl.modes import ablate


class PlayCarry(NamedTuple):
    """What a play carries from one step to the next (the field names of `rl.trainer.RolloutCarry`, whose
    window-less form eval and video carry)."""

    env_state: Any  # rl.envs.EnvBatchState
    obs: jax.Array  # [B, O]
    hidden: jax.Array | None  # [B, D] the policy reads, else None
    key: jax.Array  # PRNG key of the play


class Played(NamedTuple):
    """What `sampled_steps` stacks, one row per step (the fields of `rl.trainer.Steps` it fills)."""

    info: Any  # rl.envs.StepInfo [T, B]


def zero_on_reset(hidden: jax.Array | None, done: jax.Array) -> jax.Array | None:
    """The hidden state [B, D] after a step whose `done` [B] envs start a new episode: zeros for those ("no LLM
    reading yet": a new episode never reads its predecessor's vector) until the next refresh."""
    if hidden is None:
        return None
    return jnp.where(done[:, None], jnp.zeros_like(hidden), hidden)


def refresh_hidden(encode: Callable, llm_args, carry, mode=None, zero=None, keyed: bool = False,
                   open_window: Callable | None = None):
    """`carry` with the hidden state the policy reads from the window's first states:
    `encode(*llm_args, raw_states[, key]) -> [B, D]`. `mode` None: as the run reads it (the play's key untouched,
    as in training); a mode (traced index into `rl.modes.MODES`): a key is drawn from `carry.key` for the ablation
    (`rl.modes.ablate`, `zero`: the policy's zero) and, `keyed`, passed to `encode` too (a prompt variant's random
    tokens).

    `open_window(carry, hidden_of, key) -> carry` (None: the envs' states are read, a reset env reads zeros): the
    run's reset rule at the window start (`rl.trainer.Trainer.open_play_window`; with "pool" it reads the envs and
    a reset pool in one `hidden_of(raw_states)` call, the pool drawn with `fold_in(carry.key, 1)`, the key the
    window starts with, as the trainer's first window; the same worlds in every mode)."""
    start_key = carry.key
    if mode is None:
        hidden_of = lambda raw: encode(*llm_args, raw)  # noqa: E731
    else:
        key, k = jax.random.split(carry.key)
        hidden_of = lambda raw: ablate(encode(*llm_args, raw, *((k,) if keyed else ())), mode, k, zero)  # noqa: E731
        carry = carry._replace(key=key)
    if open_window is None:
        return carry._replace(hidden=hidden_of(carry.env_state.env_state))
    return open_window(carry, hidden_of, jax.random.fold_in(start_key, 1))


def sampled_steps(apply: Callable, env, params, carry: PlayCarry, length: int) -> tuple[PlayCarry, Played]:
    """`length` steps of a policy without a trainer: `apply(params, obs, hidden) -> (distribution, value)` samples
    its action (its distribution's own sampler), `env` (`rl.envs.BatchedEnv`) steps, a done env restarts and reads
    zeros (`zero_on_reset`). The window's keys: one split of `carry.key`, then one key per step."""
    key, k = jax.random.split(carry.key)

    def step(c, k):
        state, obs, hidden = c
        k_act, k_env = jax.random.split(k)
        pi, _ = apply(params, obs, hidden)
        action = pi.sample(seed=k_act)
        obs, state, _, done, info = env.step(k_env, state, action)
        return (state, obs, zero_on_reset(hidden, done)), info

    (state, obs, hidden), info = jax.lax.scan(step, (carry.env_state, carry.obs, carry.hidden),
                                              jax.random.split(k, length))
    return PlayCarry(state, obs, hidden, key), Played(info)


class Episodes(NamedTuple):
    """Each env's first episode: its return, length and achievements once `finished`."""

    finished: jax.Array  # bool [B]
    returns: jax.Array  # float32 [B]
    lengths: jax.Array  # int32 [B]
    achievements: jax.Array  # bool [B, A]


def no_episodes(n: int, num_achievements: int) -> Episodes:
    """Episodes of `n` envs before any finished."""
    return Episodes(jnp.zeros(n, bool), jnp.zeros(n), jnp.zeros(n, jnp.int32), jnp.zeros((n, num_achievements), bool))


def first_episodes(seen: Episodes, info) -> Episodes:
    """`seen` with the episodes that ended in a window's StepInfo [T, B] added, for envs that had none yet."""
    ended = info.episode_length > 0
    first = jnp.argmax(ended, axis=0)  # each env's first step that ended an episode
    at_first = lambda x: x[first, jnp.arange(x.shape[1])]
    new = ended.any(0) & ~seen.finished
    pick = lambda x, old: jnp.where(new.reshape(new.shape + (1,) * (old.ndim - 1)), at_first(x), old)
    return Episodes(seen.finished | new, pick(info.episode_return, seen.returns),
                    pick(info.episode_length, seen.lengths), pick(info.achievements, seen.achievements))


def fold_episodes(seen: Episodes, carry, out) -> Episodes:
    """The default fold of a window: the episodes that ended in it (`out.info`, [T, B]) added to `seen`."""
    return first_episodes(seen, out.info)


def play_window(steps: Callable, carry, seen, length: int, refresh: Callable | None = None,
                fold: Callable = fold_episodes) -> tuple[Any, Any, Any]:
    """One window of a play (pure; a tool jits it): `refresh(carry) -> carry` (the hidden-state source, None: the
    hidden state is held), `steps(carry, length) -> (carry, out)`, `fold(seen, carry, out) -> seen`. Returns
    (carry, seen, out)."""
    if refresh is not None:
        carry = refresh(carry)
    carry, out = steps(carry, length)
    return carry, fold(seen, carry, out), out


def trainer_start(trainer, n: int) -> Callable[[int], Any]:
    """start(seed) -> the carry a play of `n` envs on the trainer's scan starts from: fresh worlds (the reset key
    split from `PRNGKey(seed)`, the rest the play's key), no hidden state yet (`Trainer.play_carry`)."""
    reset = compile_program(lambda key: trainer.env.reset(key, jnp.arange(n)), runs_llm=False)

    def start(seed: int):
        k_reset, key = jax.random.split(jax.random.PRNGKey(seed))
        obs, state = reset(k_reset)
        return trainer.play_carry(obs, state, key)

    return start


def trainer_window(trainer, encode: Callable | None = None, *, zero=None, keyed: bool = False,
                   record: Callable | None = None) -> Callable:
    """The jitted window of a play on the trainer's own scan (`Trainer.run_window`: its envs, policy sampling and
    reset rule; compiled with the trainer's XLA options): run(carry, seen, params, mode, llm_args, length,
    keep=False) -> (carry, seen[, record(carry, steps)]).

    `encode` (None: no hidden state) refreshes the hidden state at every window start (`refresh_hidden`: `mode`
    None plays the run's own vectors with the key stream of training, a mode index ablates them; `zero`, `keyed`
    as there), and a reset env reads what the run's reset rule says (`Trainer.open_play_window`: its pool world's
    hidden state with "pool", zeros with "zero"). `keep` (static): also return `record(carry after the window,
    Steps with the raw states)`. The returned carry holds no hidden state and no window (the next window opens
    them)."""
    def run(carry, seen, params, mode, llm_args, length: int, keep: bool = False):
        refresh = None if encode is None else partial(refresh_hidden, encode, llm_args, mode=mode, zero=zero,
                                                      keyed=keyed, open_window=trainer.open_play_window)
        steps = lambda c, n: trainer.run_window(params, c, n, keep_states=keep)  # noqa: E731
        carry, seen, out = play_window(steps, carry, seen, length, refresh)
        result = carry._replace(hidden=None, window=None), seen
        return result + (record(carry, out),) if keep else result

    return jit_with_options(run, compiler_options=trainer.compiler_options, static_argnames=("length", "keep"))


def play_windows(run_window: Callable, carry: Any, seen: Any, max_steps: int, window: int, *,
                 clip_last: bool = False, on_window: Callable | None = None,
                 on_progress: Callable | None = None,
                 finished: Callable[[Any], bool] = lambda seen: bool(seen.finished.all())) -> tuple[Any, Any]:
    """Run `run_window(carry, seen, length)` until `finished(seen)` (default: every env finished an episode) or
    `max_steps` steps were played. `length` is `window` (`clip_last`: the last window only up to `max_steps`).
    `on_window` gets every window's third output (e.g. the recorded rollout); `on_progress` (steps played, episodes finished) after each window."""
    steps = 0
    while steps < max_steps and not finished(seen):
        length = min(window, max_steps - steps) if clip_last else window
        out = run_window(carry, seen, length)
        carry, seen = out[:2]
        if on_window is not None:
            on_window(out[2])
        steps += length
        if on_progress is not None:
            on_progress(steps, int(seen.finished.sum()))
    return carry, seen


def episode_results(seen: Episodes, running) -> dict[str, Any]:
    """numpy results of a play: each env's first episode, or for an env still playing (`running`: the batched env
    state with `episode_return` and `episode_length`) its episode so far."""
    seen, running = jax.device_get((seen, running))
    return dict(returns=np.where(seen.finished, seen.returns, running.episode_return),
                lengths=np.where(seen.finished, seen.lengths, running.episode_length),
                achievements=seen.achievements, unfinished=int((~seen.finished).sum()))


def summarise(result: dict, names) -> dict[str, Any]:
    """The eval.json entry of one mode's results (means; the per-episode values are kept for the verdict)."""
    r = result["returns"]
    return {"episodes": len(r), "return_mean": float(r.mean()),
            "return_stderr": float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0,
            "length_mean": float(result["lengths"].mean()), "unfinished": result["unfinished"],
            "achievements": {n: float(x) for n, x in zip(names, result["achievements"].mean(0))},
            # per episode, in env order (env i plays the same world in every mode): the paired verdict's data
            "episode_returns": [float(x) for x in r],
            "episode_achievements": np.asarray(result["achievements"], np.int8).tolist()}

"""Base states for the pairs: the run's own policy playing, each state taken at a random time.

`n` envs play `steps` steps (the policy samples its actions, as in training; an env whose episode ends
restarts in a fresh world); env i's state is kept at a random step in [window, steps], so the states are spread
over episode time (and over the floors the policy reaches), not bunched at the start. With an LLM the
hidden state is refreshed from the current states every `skip_n` steps (the in-scan encoder on the run's
template), as the run computes it. The play is `rl.play`'s loop: `refresh_hidden`, `sampled_steps` (the policy
has no trainer: an offline one plays here too), and a fold that keeps each env's state after its picked window.
Once env i's state is kept its later play is never read: the LLM skips its prompts (length 0), and the play stops
after the last window that keeps a state.
A reset env reads zeros until the next refresh whatever the run's `--reset-hidden` (the probe's policy carries no
reset rule, and offline policies have none): with a "pool" run the base states after a reset differ a little from
what training's play would reach (they are a sample of states, not a score); rl.eval and the video pool as the
run did (`rl.play.trainer_window`).
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rl.envs import BatchedEnv
from rl.jit import compile_llm, compile_program
from rl.play import PlayCarry, play_window, play_windows, refresh_hidden, sampled_steps
from rl.probe.parts import ProbePolicy


class Kept(NamedTuple):
    """What the base-state play keeps: each env's state, taken after the window its countdown reaches 0 in."""

    states: Any  # raw EnvStates [n]
    windows_left: jax.Array  # int32 [n]: windows still to play before env i's state is taken


class Play:
    """The base-state play of `policy` prepared (see module docstring; deterministic in `seed`): the window program
    built and its inputs' shapes known, nothing run or compiled. `compile()` returns the window's executable and
    `reset()` resets the envs (for `CompileAhead`: the probe runs both beside its other programs' compiles, before
    any window runs); `play(say, run)` plays the windows and returns the raw EnvStates [n]."""

    def __init__(self, policy: ProbePolicy, n: int, seed: int, steps: int = 1024):
        self.env = BatchedEnv(policy.env, n, reset_ratio=1)
        window = (policy.skip_n or steps) if policy.uses_hidden else 16
        self.window = window = max(1, min(window, steps))
        self.chunks = max(1, steps // window)
        self.keys = jax.random.split(jax.random.PRNGKey(seed), 3)  # (reset, pick, play)
        self.policy, self.n = policy, n
        self.llm_args = policy.llm.args if policy.uses_hidden else None
        self.run = _window(policy, self.env)
        # committed to the device as the play's own outputs are: every window runs the one executable
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                                   jax.eval_shape(self._initial))
        self.carry = self.seen = self.last = None  # `reset()` sets them

    def _initial(self) -> tuple[PlayCarry, Kept]:
        """(carry, seen) before the first window: the envs reset, each env's window to keep drawn."""
        k_reset, k_pick, key = self.keys
        pick = jax.random.randint(k_pick, (self.n,), 0, self.chunks)  # the window after which env i's state is kept
        obs, state = self.env.reset(k_reset)
        return PlayCarry(state, obs, None, key), Kept(state.env_state, pick)

    def reset(self) -> None:
        """Reset the envs (the reset compiles on its first call: seconds on a GPU) and draw the kept windows."""
        self.carry, self.seen = jax.device_put(self._initial(), jax.devices()[0])
        self.last = int(self.seen.windows_left.max())

    def compile(self):
        """The window's executable: (params, llm_args, carry, seen) -> (carry, seen), compiled now from the shapes
        (the envs need not be reset yet)."""
        from jaxllm.compile import compile_ahead

        return compile_ahead(self.run, self.policy.params, self.llm_args, *self.shapes, length=self.window)

    def play(self, say=lambda text: None, run=None):
        """Raw EnvStates [n]; `run`: the window's executable from `compile()` (None: the first window compiles it).
        `say`: progress."""
        if self.carry is None:
            self.reset()
        policy, last, window = self.policy, self.last, self.window
        ahead = run is not None
        if run is None:
            jitted = self.run
            run = lambda params, llm_args, carry, seen: jitted(params, llm_args, carry, seen, window)  # noqa: E731
        llm_part = " (the LLM on each window's states)" if policy.uses_hidden else ""
        compiled = "the play compiled ahead" if ahead else "the first window compiles the play"
        say(f"playing {self.n} envs x {last + 1} of {self.chunks} windows of {window} steps with the policy for base "
            f"states{llm_part}; {compiled} ...")
        t0, played = time.perf_counter(), [0]
        report = max(1, (last + 1) // 8)

        def run_window(carry, seen, length):
            carry, seen = run(policy.params, self.llm_args, carry, seen)
            c = played[0]
            played[0] += 1
            if c == 0 or (c + 1) % report == 0 or c == last:
                jax.block_until_ready(seen)
                first = " (first window with its compile)" if c == 0 and not ahead else ""
                say(f"  played window {c + 1}/{last + 1}: {time.perf_counter() - t0:.1f} s{first}")
            return carry, seen

        _, kept = play_windows(run_window, self.carry, self.seen, (last + 1) * window, window,
                               finished=lambda seen: False)
        return kept.states


def play_states(policy: ProbePolicy, n: int, seed: int, steps: int = 1024, say=lambda text: None):
    """Raw EnvStates [n] of `policy` playing (see module docstring); deterministic in `seed`. `say`: progress."""
    return Play(policy, n, seed, steps).play(say)


def base_state_shapes(policy: ProbePolicy, n: int):
    """The shapes and dtypes of `play_states`' result (no play, nothing compiled)."""
    env = BatchedEnv(policy.env, n, reset_ratio=1)
    _, state = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    return state.env_state


def keep_picked(seen: Kept, carry: PlayCarry, out) -> Kept:
    """The fold of a window: the states after it kept for the envs whose countdown is 0."""
    take = seen.windows_left == 0
    mask = lambda a: take.reshape(take.shape + (1,) * (a.ndim - 1))  # noqa: E731
    states = jax.tree.map(lambda new, old: jnp.where(mask(new), new, old), carry.env_state.env_state, seen.states)
    return Kept(states, seen.windows_left - 1)


def _window(policy: ProbePolicy, env: BatchedEnv):
    """The jitted window: run(params, llm_args, carry, seen, length) -> (carry, seen)."""
    llm = policy.llm

    @partial(compile_llm if llm is not None else partial(compile_program, runs_llm=False), static_argnames="length")
    def run(params, llm_args, carry, seen, length: int):
        refresh = None
        if llm is not None:
            def encode(p, c, raw):
                ids, lengths = jax.vmap(llm.template)(raw)
                # a kept env's prompt is not computed (its later play is never read)
                return llm.encode_ids(p, c, ids, jnp.where(seen.windows_left >= 0, lengths, 0))

            refresh = partial(refresh_hidden, encode, llm_args)
        carry, seen, _ = play_window(partial(sampled_steps, policy.apply, env, params), carry, seen, length, refresh,
                                     fold=keep_picked)
        # the next window refreshes the hidden state before reading it: the carry goes back without it, so every
        # window takes the first's arguments (a carry holding a hidden state compiled the play a second time)
        return carry._replace(hidden=None), seen

    return run

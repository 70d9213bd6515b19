"""Base states for the pairs: the run's own policy playing, each state taken at a random time.

`n` envs play `steps` steps (the policy samples its actions, as in training; an env whose episode ends
restarts in a fresh world); env i's state is kept at a random step in [window, steps], so the states are spread
over episode time (and over the floors the policy reaches), not bunched at the start. With an LLM the
hidden state is refreshed from the current states every `skip_n` steps (the in-scan encoder on the run's
template), as the run computes it.
"""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp

from rl.envs import BatchedEnv
from rl.jit import compile_llm, compile_program
from rl.probe.parts import ProbePolicy


def play_states(policy: ProbePolicy, n: int, seed: int, steps: int = 1024, say=lambda text: None):
    """Raw EnvStates [n] of `policy` playing (see module docstring); deterministic in `seed`. Once env i's state is
    kept, its later play is never read: the LLM skips its prompts (length 0), and the play stops after the last
    window that keeps a state."""
    env = BatchedEnv(policy.env, n, reset_ratio=1)
    window = (policy.skip_n or steps) if policy.uses_hidden else 16
    window = max(1, min(window, steps))
    chunks = max(1, steps // window)
    k_reset, k_pick, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    pick = jax.random.randint(k_pick, (n,), 0, chunks)  # the chunk after which env i's state is kept
    obs, state = env.reset(k_reset)
    # committed to the device as the play's own outputs are: the second window then reuses the first's compile
    obs, state = jax.device_put((obs, state), jax.devices()[0])
    kept = state.env_state
    llm_args = policy.llm.args if policy.uses_hidden else None
    advance = _advance(policy, env, window)
    last = int(pick.max())
    llm_part = " (the LLM on each window's states)" if policy.uses_hidden else ""
    say(f"playing {n} envs x {last + 1} of {chunks} windows of {window} steps with the policy for base states"
        f"{llm_part}; the first window compiles the play ...")
    t0 = time.perf_counter()
    report = max(1, (last + 1) // 8)
    for c in range(last + 1):
        key, k = jax.random.split(key)
        state, obs, kept = advance(policy.params, llm_args, state, obs, kept, pick, jnp.int32(c), k)
        if c == 0 or (c + 1) % report == 0 or c == last:
            jax.block_until_ready(kept)
            say(f"  played window {c + 1}/{last + 1}: {time.perf_counter() - t0:.1f} s"
                f"{' (first window with its compile)' if c == 0 else ''}")
    return kept


def base_state_shapes(policy: ProbePolicy, n: int):
    """The shapes and dtypes of `play_states`' result (no play, nothing compiled)."""
    env = BatchedEnv(policy.env, n, reset_ratio=1)
    _, state = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    return state.env_state


def _advance(policy: ProbePolicy, env: BatchedEnv, window: int):
    llm = policy.llm

    @partial(compile_llm if llm is not None else partial(compile_program, runs_llm=False))
    def advance(params, llm_args, state, obs, kept, pick, chunk, key):
        take = pick == chunk
        hidden = None
        if llm is not None:
            ids, lengths = jax.vmap(llm.template)(state.env_state)
            lengths = jnp.where(pick >= chunk, lengths, 0)  # a kept env's prompt is not computed (never read)
            hidden = llm.encode_ids(*llm_args, ids, lengths)

        def step(carry, k):
            state, obs, hidden = carry
            k_act, k_env = jax.random.split(k)
            pi, _ = policy.apply(params, obs, hidden)
            action = pi.sample(seed=k_act)
            obs, state, _, done, _ = env.step(k_env, state, action)
            if hidden is not None:  # a new episode never reads its predecessor's vector (zeros until the window ends)
                hidden = jnp.where(done[:, None], 0.0, hidden)
            return (state, obs, hidden), None

        (state, obs, _), _ = jax.lax.scan(step, (state, obs, hidden), jax.random.split(key, window))
        mask = lambda a: take.reshape(take.shape + (1,) * (a.ndim - 1))
        kept = jax.tree.map(lambda new, old: jnp.where(mask(new), new, old), state.env_state, kept)
        return state, obs, kept

    return advance

"""The policy on a batch of pairs under every hidden-state mode: one jitted call per kind.

Hidden-state modes (the one table, `rl.modes`, applied to pairs):
    real          the in-scan encoder on the prompt of each side, exactly as the run computes it
    zero          the policy's zero on both sides (raw zeros online; an offline policy's dataset mean)
    noise         per-feature mean and std of the batch's real vectors, the SAME draw on both sides of a pair
    shuffled      each side reads the real vector of the same side of another pair (rolled by one)
    other_prompt  the real model on the same ids behind rl.modes.OTHER_PROMPT
zero/noise isolate what the observation alone does; noise and shuffled depend on the batch (the others are
per pair: a batch gives what one pair at a time gives).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from rl.jit import compile_llm, compile_program
from rl.modes import MODES, shuffled
from rl.probe.parts import ProbePolicy


def modes_for(policy: ProbePolicy) -> tuple[str, ...]:
    """Every mode for a policy that reads a hidden state; only `real` without one."""
    return MODES if policy.uses_hidden else ("real",)


def make_prepare(policy: ProbePolicy):
    """Jitted (low states [N], high states [N]) -> (obs_low, obs_high [N, O], ids_low, ids_high [N, T] | None,
    len_low, len_high [N] | None): craftax's own observation and the run's template of both sides."""
    from render.envs import make_raw_env

    raw_env, _ = make_raw_env(policy.env)
    template = policy.llm.template if policy.uses_hidden else None

    @partial(compile_program, runs_llm=False)
    def prepare(low, high):
        obs = [jax.vmap(raw_env.get_obs)(s).astype(jnp.float32) for s in (low, high)]
        if template is None:
            return obs[0], obs[1], None, None, None, None
        (il, ll), (ih, lh) = (jax.vmap(template)(s) for s in (low, high))
        return obs[0], obs[1], il, ih, ll, lh

    return prepare


def make_forward(policy: ProbePolicy, modes: tuple[str, ...]):
    """Jitted f(params, llm_args, other_args, obs_low, obs_high, ids_low, ids_high, len_low, len_high, key) ->
    (values f32 [M, 2, N], log-probs f32 [M, 2, N, A]) for the M `modes` (side 0 low, 1 high). ids of both
    sides share one width; llm/ids arguments are None for a policy without hidden state."""
    llm, zero = policy.llm, policy.zero
    bad = [m for m in modes if m not in MODES or (llm is None and m != "real")]
    if bad:
        raise ValueError(f"hidden-state modes {bad} do not apply; this policy takes {modes_for(policy)}")

    @partial(compile_llm if llm is not None else partial(compile_program, runs_llm=False))
    def forward(params, llm_args, other_args, obs_low, obs_high, ids_low, ids_high, len_low, len_high, key):
        n = obs_low.shape[0]
        obs = jnp.concatenate([obs_low, obs_high])
        if llm is None:
            pi, v = policy.apply(params, obs, None)
            logp = jax.nn.log_softmax(pi.logits)
            return v.reshape(1, 2, n), logp.reshape(1, 2, n, -1)
        ids, lengths = jnp.concatenate([ids_low, ids_high]), jnp.concatenate([len_low, len_high])
        real = llm.encode_ids(*llm_args, ids, lengths).astype(jnp.float32)
        hidden = []
        for mode in modes:
            if mode == "real":
                h = real
            elif mode == "zero":
                h = jnp.zeros_like(real) if zero is None else jnp.broadcast_to(zero, real.shape).astype(real.dtype)
            elif mode == "noise":
                draw = jax.random.normal(key, (n, real.shape[1]), real.dtype)
                h = jnp.tile(real.mean(0) + real.std(0) * draw, (2, 1))
            elif mode == "shuffled":
                h = jnp.concatenate([shuffled(real[:n]), shuffled(real[n:])])
            else:  # other_prompt
                h = llm.encode_ids(*other_args, ids, lengths).astype(jnp.float32)
            hidden.append(h)

        def one(h):
            pi, v = policy.apply(params, obs, h)
            return v, jax.nn.log_softmax(pi.logits)

        v, logp = jax.vmap(one)(jnp.stack(hidden))
        return v.reshape(len(modes), 2, n), logp.reshape(len(modes), 2, n, -1)

    return forward


def pad_ids(ids, width: int, pad_id: int):
    """ids [N, T] right-padded with `pad_id` to [N, width]."""
    return jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=pad_id)

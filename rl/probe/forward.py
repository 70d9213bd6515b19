"""The policy on a batch of pairs under every hidden-state mode, as two compiled programs that every kind shares:
`make_encode` (the LLM on both sides' prompts: the real and the other-prompt vectors) and `make_heads` (the
policy's value and log-probs under each mode, from those vectors).

Hidden-state modes (the one table, `rl.modes`, applied to pairs):
    real          the in-scan encoder on the prompt of each side, exactly as the run computes it
    zero          the policy's zero on both sides (raw zeros online; an offline policy's dataset mean)
    noise         per-feature mean and std of the batch's real vectors, the SAME draw on both sides of a pair
    shuffled      each side reads the real vector of the same side of another pair (rolled by one)
    other_prompt  the real model on the same ids behind rl.modes.OTHER_PROMPT
zero/noise isolate what the observation alone does; noise and shuffled depend on the batch (the others are
per pair: a batch gives what one pair at a time gives).

Splitting the LLM from the heads lets a kind whose prompts equal another kind's (e.g. `prompt:health` and
`health`: the same ids on both sides) reuse that kind's vectors: the encode is a deterministic function of its
inputs, so reuse gives the vectors a second call would.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl.jit import compile_llm, compile_program
from rl.modes import MODES, shuffled
from rl.probe.parts import ProbePolicy


def modes_for(policy: ProbePolicy) -> tuple[str, ...]:
    """Every mode for a policy that reads a hidden state; only `real` without one."""
    return MODES if policy.uses_hidden else ("real",)


def check_modes(policy: ProbePolicy, modes: tuple[str, ...]) -> None:
    """ValueError (one line) for a mode that does not apply to `policy`."""
    bad = [m for m in modes if m not in MODES or (policy.llm is None and m != "real")]
    if bad:
        raise ValueError(f"hidden-state modes {bad} do not apply; this policy takes {modes_for(policy)}")


def encode_fn(policy: ProbePolicy, modes: tuple[str, ...]):
    """Pure (llm_args, other_args, ids_low, ids_high [N, T], len_low, len_high [N]) -> (real f32 [2N, D], other
    f32 [2N, D] | None): the run's LLM on both sides (low first), and on the same ids behind the other prompt when
    `modes` take it."""
    llm = policy.llm

    def encode(llm_args, other_args, ids_low, ids_high, len_low, len_high):
        ids, lengths = jnp.concatenate([ids_low, ids_high]), jnp.concatenate([len_low, len_high])
        real = llm.encode_ids(*llm_args, ids, lengths).astype(jnp.float32)
        other = llm.encode_ids(*other_args, ids, lengths).astype(jnp.float32) if "other_prompt" in modes else None
        return real, other

    return encode


def heads_fn(policy: ProbePolicy, modes: tuple[str, ...]):
    """Pure (params, obs_low, obs_high [N, O], real [2N, D] | None, other [2N, D] | None, key) -> (values f32
    [M, 2, N], log-probs f32 [M, 2, N, A]) for the M `modes` (side 0 low, 1 high); real/other None for a policy
    without hidden state."""
    zero = policy.zero

    def heads(params, obs_low, obs_high, real, other, key):
        n = obs_low.shape[0]
        obs = jnp.concatenate([obs_low, obs_high])
        if real is None:
            pi, v = policy.apply(params, obs, None)
            logp = jax.nn.log_softmax(pi.logits)
            return v.reshape(1, 2, n), logp.reshape(1, 2, n, -1)
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
                h = other
            hidden.append(h)

        def one(h):
            pi, v = policy.apply(params, obs, h)
            return v, jax.nn.log_softmax(pi.logits)

        v, logp = jax.vmap(one)(jnp.stack(hidden))
        return v.reshape(len(modes), 2, n), logp.reshape(len(modes), 2, n, -1)

    return heads


def make_prepare(policy: ProbePolicy):
    """Jitted (low states [N], high states [N]) -> (obs_low, obs_high [N, O], ids_low, ids_high [N, T] | None,
    len_low, len_high [N] | None): craftax's own observation and the run's template of both sides."""
    from render.envs import make_raw_env

    raw_env, _ = make_raw_env(policy.env)
    template = policy.llm.template if policy.uses_hidden else None

    def prepare(low, high):
        obs = [jax.vmap(raw_env.get_obs)(s).astype(jnp.float32) for s in (low, high)]
        if template is None:
            return obs[0], obs[1], None, None, None, None
        (il, ll), (ih, lh) = (jax.vmap(template)(s) for s in (low, high))
        return obs[0], obs[1], il, ih, ll, lh

    return compile_program(prepare, runs_llm=False)


def make_encode(policy: ProbePolicy, modes: tuple[str, ...]):
    """`encode_fn` compiled as a program that runs the LLM (`rl.jit.compile_llm`); None without an LLM."""
    check_modes(policy, modes)
    return None if policy.llm is None else compile_llm(encode_fn(policy, modes))


def make_heads(policy: ProbePolicy, modes: tuple[str, ...]):
    """`heads_fn` compiled (no LLM inside: `compile_program(runs_llm=False)`)."""
    check_modes(policy, modes)
    return compile_program(heads_fn(policy, modes), runs_llm=False)


def make_forward(policy: ProbePolicy, modes: tuple[str, ...]):
    """The two programs as one call: f(params, llm_args, other_args, obs_low, obs_high, ids_low, ids_high, len_low,
    len_high, key) -> (values [M, 2, N], log-probs [M, 2, N, A]); llm/ids arguments None without hidden state."""
    encode, heads = make_encode(policy, modes), make_heads(policy, modes)

    def forward(params, llm_args, other_args, obs_low, obs_high, ids_low, ids_high, len_low, len_high, key):
        real, other = (None, None) if encode is None else encode(llm_args, other_args, ids_low, ids_high, len_low,
                                                                  len_high)
        return heads(params, obs_low, obs_high, real, other, key)

    return forward


def pad_ids(ids, width: int, pad_id: int):
    """ids [N, T] right-padded with `pad_id` to [N, width]."""
    return jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=pad_id)



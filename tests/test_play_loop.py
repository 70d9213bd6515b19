"""The one play loop (rl.play, issue 34 point 3) plays exactly as the loops it replaced: the video's frames, eval's
results and the probe's base states equal those of the straightforward loops each tool had before (written out
here as the reference, with their own key handling), for a policy without and with the tiny LLM.

Untrained policies (random init) on Classic; the video's pixel renderer is replaced by a cheap one of the state (the
frames still show every step's state and the text the LLM read).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from render.envs import CLASSIC
from rl.config import PRESETS, TrainConfig
from rl.modes import ablate
from rl.play import first_episodes, no_episodes

N, SEED, MAX_STEPS = 3, 5, 20


@pytest.fixture(scope="module", params=["none", "inscan"])
def policy(request):
    """An `rl.runs.RunPolicy` of an untrained run: the trainer of the test preset and its initial params."""
    from rl.encoder_kinds import InScanEncoder
    from rl.llm import load_llm
    from rl.runs import RunPolicy
    from rl.trainer import Trainer

    cfg = TrainConfig(**dict(PRESETS["test"], encoder=request.param, devices=1, skip_n=4),
                      **({"model": "tiny", "llm_dtype": "float32"} if request.param == "inscan" else {}))
    llm = load_llm(cfg) if cfg.uses_llm else None
    encoder = InScanEncoder(cfg.hidden, cfg.llm, llm) if llm is not None else None
    trainer = Trainer.from_config(cfg, encoder)
    runner = trainer.init_state(trainer.encoder.jit_args())
    return RunPolicy(cfg, trainer, runner, 0, llm, encoder.encode if encoder is not None else None)


def _fake_renderer(env_name):
    """Pixels of a state: the player's position and the step counter, broadcast to a 4 x 4 image."""
    def render(states):
        v = jnp.concatenate([states.player_position, states.timestep[..., None]], -1).astype(jnp.uint8)
        return jnp.broadcast_to(v[..., None, None, :1], v.shape[:-1] + (4, 4, 1)).repeat(3, -1) + v[..., None, None, 1:2]
    return jax.jit(jax.vmap(render))


def _old_video_frames(policy, n, seed, max_steps, render, obs_text):
    """rl.video's loop before the one play loop: encode the window's first states (its own jit), then the trainer's
    window scan with the params closed over, frames until each env's first episode ends."""
    from rl.trainer import RolloutCarry
    from rl.video import _font, compose_frame

    trainer, encode = policy.trainer, policy.encode
    window = policy.cfg.skip_n if policy.llm is not None else 16
    encode = jax.jit(encode) if encode is not None else None
    play_window = jax.jit(lambda carry: trainer.run_window(policy.params, carry, window, keep_states=True))
    k_reset, key = jax.random.split(jax.random.PRNGKey(seed))
    obs, state = jax.jit(lambda k: trainer.env.reset(k, jnp.arange(n)))(k_reset)
    carry = RolloutCarry(state, obs, None, key)
    per_env, done, t, font = [[] for _ in range(n)], np.zeros(n, bool), 0, _font()
    while t < max_steps and not done.all():
        raw = carry.env_state.env_state
        if encode is not None:
            carry = carry._replace(hidden=encode(*policy.llm_args, raw))
        texts = [obs_text(jax.tree.map(lambda x: x[i], raw)) for i in range(n)]
        carry, steps = play_window(carry)
        pixels = np.asarray(jax.vmap(render, in_axes=1, out_axes=1)(steps.states))
        ended = np.asarray(steps.info.episode_length > 0)
        for k in range(min(window, max_steps - t)):
            for i in np.flatnonzero(~done):
                caption = f"episode {i + 1}, step {t + k + 1}" + (
                    f"; the LLM read this at step {t + 1} (every {window} steps)" if encode is not None else "")
                per_env[i].append(compose_frame(pixels[k, i], texts[i], caption, font))
                if ended[k, i]:
                    done[i] = True
        t += window
    return per_env


def test_video_frames_equal_the_straightforward_loop(policy, monkeypatch):
    import rl.video as video

    monkeypatch.setattr(video, "_pixel_renderer", _fake_renderer)
    new = video.play_frames(policy, N, SEED, MAX_STEPS)
    old = _old_video_frames(policy, N, SEED, MAX_STEPS, _fake_renderer(CLASSIC),
                            video._observation_text(policy.cfg, policy.llm))
    assert [len(f) for f in new] == [len(f) for f in old] and sum(map(len, new)) > N
    for a, b in zip(new, old):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def _old_eval(policy, seed, max_steps, mode):
    """rl.eval's player before the one play loop: per window a key split for the ablation, the encoded and ablated
    hidden state, the trainer's window scan, first episodes."""
    from rl.play import episode_results
    from rl.trainer import RolloutCarry

    trainer, encode, env = policy.trainer, policy.encode, policy.trainer.env

    @partial(jax.jit, static_argnames="window")
    def run_window(carry, seen, params, mode, llm_params, cache, window):
        if encode is not None:
            key, k = jax.random.split(carry.key)
            carry = carry._replace(hidden=ablate(encode(llm_params, cache, carry.env_state.env_state), mode, k),
                                   key=key)
        carry, steps = trainer.run_window(params, carry, window)
        return carry._replace(hidden=None), first_episodes(seen, steps.info)

    window = (policy.cfg.skip_n or max_steps) if encode is not None else min(64, max_steps)
    k_reset, key = jax.random.split(jax.random.PRNGKey(seed))
    obs, state = jax.jit(lambda k: env.reset(k, jnp.arange(N)))(k_reset)
    carry, seen, steps = RolloutCarry(state, obs, None, key), no_episodes(N, len(env.achievement_names)), 0
    while steps < max_steps and not bool(seen.finished.all()):
        carry, seen = run_window(carry, seen, policy.params, jnp.int32(mode), *policy.llm_args, window=window)
        steps += window
    return episode_results(seen, carry.env_state)


def test_eval_results_equal_the_straightforward_loop(policy):
    from rl.eval import make_player

    modes = (0, 2, 3) if policy.llm is not None else (0,)  # real, noise, shuffled
    play = make_player(policy.trainer, N, policy.encode, policy.cfg.skip_n)
    for mode in modes:
        new = play(policy.params, SEED, MAX_STEPS, mode, policy.llm_args)
        old = _old_eval(policy, SEED, MAX_STEPS, mode)
        for k in ("returns", "lengths", "achievements"):
            np.testing.assert_array_equal(new[k], old[k])
        assert new["unfinished"] == old["unfinished"]


def _old_play_states(probe, n, seed, steps):
    """rl.probe.states before the one play loop: per window a host key split, the hidden state of the window's first
    states, a scan that samples from the policy's distribution, zeros for a reset env, the picked window's states."""
    from rl.envs import BatchedEnv

    env = BatchedEnv(probe.env, n, reset_ratio=1)
    llm = probe.llm
    window = max(1, min((probe.skip_n or steps) if probe.uses_hidden else 16, steps))
    chunks = max(1, steps // window)
    k_reset, k_pick, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    pick = jax.random.randint(k_pick, (n,), 0, chunks)
    obs, state = env.reset(k_reset)
    kept = state.env_state

    @jax.jit
    def advance(params, llm_args, state, obs, kept, take, key):
        hidden = None
        if llm is not None:
            ids, lengths = jax.vmap(llm.template)(state.env_state)
            hidden = llm.encode_ids(*llm_args, ids, lengths)

        def step(carry, k):
            state, obs, hidden = carry
            k_act, k_env = jax.random.split(k)
            pi, _ = probe.apply(params, obs, hidden)
            obs, state, _, done, _ = env.step(k_env, state, pi.sample(seed=k_act))
            if hidden is not None:
                hidden = jnp.where(done[:, None], 0.0, hidden)
            return (state, obs, hidden), None

        (state, obs, _), _ = jax.lax.scan(step, (state, obs, hidden), jax.random.split(key, window))
        mask = lambda a: take.reshape(take.shape + (1,) * (a.ndim - 1))  # noqa: E731
        return state, obs, jax.tree.map(lambda new, old: jnp.where(mask(new), new, old), state.env_state, kept)

    for c in range(chunks):
        key, k = jax.random.split(key)
        state, obs, kept = advance(probe.params, llm.args if llm else None, state, obs, kept, pick == c, k)
    return kept


def test_probe_base_states_equal_the_straightforward_loop(policy):
    from rl.probe.policy import ProbePolicy, _llm_parts
    from rl.probe.states import play_states

    llm = policy.llm
    parts = None if llm is None else _llm_parts(policy.cfg, llm.model, llm.tokenizer, llm.template, llm.prefix_cache)
    probe = ProbePolicy("untrained", CLASSIC, policy.params, policy.trainer.apply, parts, policy.cfg.skip_n, 0.99)
    new = play_states(probe, N, seed=3, steps=24)
    old = _old_play_states(probe, N, 3, 24)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
        np.testing.assert_array_equal(a, b)

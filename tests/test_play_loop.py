"""The one play loop (rl.play, issue 34 point 3) plays exactly as the loops it replaced: the video's frames, eval's
results and the probe's base states equal those of the straightforward loops each tool had before (written out
here as the reference, with their own key handling), for a policy without and with the tiny LLM.

Untrained policies (random init) on Classic; the video's pixel renderer is replaced by a cheap one of the state (the
frames still show every step's state and the text the LLM read). Those runs reset with zeros (`--reset-hidden zero`);
a "pool" run's play (a reset env restarts in its block's pool world and reads its hidden state, as in training) is
checked against the trainer's in-scan rollout and against a straightforward loop written out here.
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
                      **({"model": "tiny", "llm_dtype": "float32", "reset_hidden": "zero"}
                         if request.param == "inscan" else {}))
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


# --reset-hidden pool ------------------------------------------------------------------------------------------------
POOL_N, POOL_WINDOW, POOL_WINDOWS = 3, 4, 3


@pytest.fixture(scope="module")
def pool_policy():
    """(trainer, runner, llm, encoder) of an untrained "pool" run whose episodes end after 3 steps (craftax's
    max_timesteps), so every window has resets; reset blocks of 2 envs (2 pool worlds for 3 envs)."""
    from rl.encoder_kinds import InScanEncoder
    from rl.llm import load_llm
    from rl.trainer import Trainer

    cfg = TrainConfig(**dict(PRESETS["test"], encoder="inscan", devices=1, skip_n=POOL_WINDOW, reset_ratio=2,
                             reset_hidden="pool", model="tiny", llm_dtype="float32"))
    llm = load_llm(cfg)
    encoder = InScanEncoder(cfg.hidden, cfg.llm, llm)
    trainer = Trainer.from_config(cfg, encoder)
    env = trainer.env
    object.__setattr__(env, "_params", env.env_params.replace(max_timesteps=3))  # before anything is traced
    return trainer, trainer.init_state(encoder.jit_args()), llm, encoder


def _pool_play(pool_policy, mode):
    """The play loop's windows (rl.play.trainer_window) of the pool run: each window's Steps with raw states."""
    from rl.play import play_windows, trainer_start, trainer_window

    trainer, runner, llm, encoder = pool_policy
    run = trainer_window(trainer, encoder.encode, record=lambda carry, steps: steps)
    windows = []
    step = lambda carry, seen, length: run(carry, seen, runner.params, mode, llm.jit_args, length=length,  # noqa: E731
                                           keep=True)
    play_windows(step, trainer_start(trainer, POOL_N)(SEED), no_episodes(POOL_N, len(trainer.env.achievement_names)), POOL_WINDOW * POOL_WINDOWS,
                 POOL_WINDOW, on_window=windows.append, finished=lambda seen: False)
    return windows


def _straight_pool_play(pool_policy, mode):
    """A pool run's play written out: per window the pool worlds drawn with fold_in(key, 1), the envs and the pool
    read in one encode call (ablated as one batch), then every step by hand: the policy samples per env, the env
    steps with the pool, a done env reads its block's pool hidden state."""
    from rl.sharding import keys_per_index

    trainer, runner, llm, encoder = pool_policy
    env, idx = trainer.env, jnp.arange(POOL_N)
    slots = idx // 2

    @jax.jit
    def window(state, obs, key, mode):
        k_pool = jax.random.fold_in(key, 1)
        pool = env.reset_pool(k_pool, idx)
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), state.env_state, pool[1])
        h = encoder.encode(*llm.jit_args, both)
        if mode is not None:
            key, k = jax.random.split(key)
            h = ablate(h, mode, k)
        hidden, pool_hidden = h[:POOL_N], h[POOL_N:]
        rows = []
        for _ in range(POOL_WINDOW):
            key, k_act, k_env = jax.random.split(key, 3)
            pi, _ = trainer.apply(runner.params, obs, hidden)
            action = jax.vmap(jax.random.categorical)(keys_per_index(k_act, idx), pi.logits)
            rows.append((obs, hidden, action, state.env_state.timestep))
            obs, state, _, done, _ = env.step(k_env, state, action, idx, pool)
            hidden = jnp.where(done[:, None], pool_hidden[slots], hidden)
        return state, obs, key, jax.tree.map(lambda *x: jnp.stack(x), *rows), pool, pool_hidden

    k_reset, key = jax.random.split(jax.random.PRNGKey(SEED))
    obs, state = env.reset(k_reset, idx)
    out = []
    for _ in range(POOL_WINDOWS):
        state, obs, key, rows, pool, pool_hidden = window(state, obs, key, mode)
        out.append((rows, pool, pool_hidden))
    return out


@pytest.mark.parametrize("mode", [None, 2])  # the run's own vectors; noise (one batch with the pool)
def test_pool_run_plays_pool_worlds_and_their_hidden_states_at_resets(pool_policy, mode):
    new = _pool_play(pool_policy, None if mode is None else jnp.int32(mode))
    old = _straight_pool_play(pool_policy, mode)
    assert len(new) == len(old) == POOL_WINDOWS
    resets = 0
    for steps, (rows, pool, pool_hidden) in zip(new, old):
        tr = steps.transition
        for a, b in zip((tr.obs, tr.hidden, tr.action, steps.states.timestep), rows, strict=True):
            np.testing.assert_array_equal(a, b)
        # a step after a reset: the env's pool world (its observation) and that world's hidden state, not zeros
        after = np.asarray(tr.done[:-1])
        for t, i in zip(*np.nonzero(after)):
            resets += 1
            np.testing.assert_array_equal(tr.obs[t + 1, i], pool[0][i // 2])
            np.testing.assert_array_equal(tr.hidden[t + 1, i], pool_hidden[i // 2])
            assert np.abs(np.asarray(tr.hidden[t + 1, i])).sum() > 0
    assert resets >= POOL_N  # every env reset inside a window at least once


def test_pool_run_first_window_equals_the_trainers_rollout(pool_policy):
    """The play's first window (the run's own vectors) is the trainer's in-scan rollout of one window opened by
    the encoder (`InScanEncoder.open`: the same pool key), step for step: the same worlds, observations, actions
    and resets; float values (hidden states, values, log-probabilities) to float rounding, since the rollout's scan
    body also holds the LLM window's `lax.cond` and XLA fuses it differently."""
    from rl.play import trainer_start
    from rl.trainer import RolloutCarry

    trainer, runner, llm, encoder = pool_policy
    (play,) = _pool_play(pool_policy, None)[:1]
    start = trainer_start(trainer, POOL_N)(SEED)
    idx = jnp.arange(POOL_N)
    hidden, window = jax.jit(lambda a, s, k: encoder.open(a, s, k, idx, trainer.env))(
        llm.jit_args, start.env_state, jax.random.fold_in(start.key, 1))
    carry = RolloutCarry(start.env_state, start.obs, hidden, start.key, window)
    _, steps = jax.jit(lambda c, a: trainer.run_window(runner.params, c, POOL_WINDOW, keep_states=True,
                                                        llm_args=a))(carry, llm.jit_args)
    assert bool(steps.transition.done[:-1].any())
    for a, b in zip(jax.tree.leaves(play), jax.tree.leaves(steps), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


def test_an_http_run_plays_with_the_reset_rule_it_trained_with(tmp_path):
    """A `vllm` run (reset rule "zero": the HTTP host loop has no pool) is played with the in-scan encoder; its
    "auto" would read "pool" there, so `play_settings` pins the rule it trained with."""
    from rl.config import save_config
    from rl.readrun import play_settings

    for reset_hidden, expect in (("auto", "zero"), ("zero", "zero")):
        save_config(TrainConfig(**dict(PRESETS["test"], encoder="vllm", skip_n=4, reset_hidden=reset_hidden)),
                    tmp_path / "config.json")
        cfg = play_settings(tmp_path)
        assert cfg.encoder == "inscan" and cfg.hidden_on_reset == expect
    save_config(TrainConfig(**dict(PRESETS["test"], encoder="inscan", skip_n=4)), tmp_path / "config.json")
    assert play_settings(tmp_path).hidden_on_reset == "pool"

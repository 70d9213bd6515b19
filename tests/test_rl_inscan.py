"""In-scan LLM hidden states: equal to the encoder called outside the scan; reset envs never keep a stale one."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import PRESETS, TrainConfig
from rl.encoders import load_llm
from rl.trainer import Trainer

ENV = "Craftax-Classic-Symbolic-v1"


@pytest.fixture(scope="module")
def setup():
    cfg = TrainConfig(**dict(PRESETS["test"], env=ENV, encoder="inscan", num_envs=4, num_steps=8, skip_n=4))
    llm = load_llm(cfg)
    trainer = Trainer(cfg, llm)
    runner = trainer.init_state(llm.jit_args)
    # Env 0 starts with zero health: it dies on its first step, so a reset happens inside a window.
    es = runner.env_state
    health = es.env_state.player_health.at[0].set(jnp.zeros((), es.env_state.player_health.dtype))
    es = es._replace(env_state=es.env_state.replace(player_health=health))
    runner = runner._replace(env_state=es, hidden=trainer.encode_states(*llm.jit_args, es.env_state))
    rollout = jax.jit(lambda r, args: trainer.rollout(r.params, r.env_state, r.obs, r.hidden, r.rng, args,
                                                      keep_states=True))
    carry, traj, info, states = rollout(runner, llm.jit_args)
    return cfg, llm, runner, carry, traj, states


def _outside(llm, cfg, raw_states):
    """The encoder called outside any scan: template per state on the host side, then Model.encode."""
    ids, lengths = jax.vmap(llm.template)(raw_states)
    return np.asarray(llm.model.encode(np.asarray(ids), np.asarray(lengths), layer=cfg.llm_layer,
                                       pooling=cfg.pooling, prefix=llm.prefix_cache))


def test_window_start_hidden_equals_outside_encode(setup):
    cfg, llm, runner, carry, traj, states = setup
    assert traj.hidden.shape == (cfg.num_steps, cfg.num_envs, llm.hidden_size)
    for t in range(0, cfg.num_steps, cfg.skip_n):
        state_t = jax.tree.map(lambda x: x[t], states)
        expect = _outside(llm, cfg, state_t)
        got = np.asarray(traj.hidden[t])
        live = ~np.all(got == 0, axis=-1)  # envs reset at the step before (zeroed) are checked below
        np.testing.assert_allclose(got[live], expect[live], rtol=1e-5, atol=1e-5)
    # The hidden state carried out of the rollout (next window / bootstrap) is that of the final states.
    np.testing.assert_allclose(np.asarray(carry[2]), _outside(llm, cfg, carry[0].env_state), rtol=1e-5, atol=1e-5)
    # The first window's vectors are the ones computed at init for the initial states.
    np.testing.assert_allclose(np.asarray(traj.hidden[0][1:]), np.asarray(runner.hidden[1:]), rtol=0, atol=0)


def test_hidden_held_within_window_and_zeroed_after_reset(setup):
    cfg, llm, runner, carry, traj, states = setup
    hidden, done = np.asarray(traj.hidden), np.asarray(traj.done)
    assert done[0, 0], "env 0 was given zero health and must end its episode on the first step"
    zeroed = 0
    for t in range(cfg.num_steps):
        start = t - t % cfg.skip_n
        for i in range(cfg.num_envs):
            reset_since_start = done[start:t, i].any()
            if reset_since_start:
                assert np.all(hidden[t, i] == 0), (t, i)
                zeroed += 1
            else:
                np.testing.assert_array_equal(hidden[t, i], hidden[start, i])
    assert zeroed >= cfg.skip_n - 1  # env 0 acted with a zeroed vector until its window ended
    # ... and got a fresh, non-zero vector of its new episode at the next window.
    assert not np.all(hidden[cfg.skip_n, 0] == 0)


def test_readme_main_command_with_test_preset(tmp_path):
    """The README's `python -m rl.train --encoder=inscan --preset cpu`, shrunk to the test preset."""
    from rl.eval import evaluate
    from rl.train import main

    run_dir = tmp_path / "inscan"
    assert main(["--encoder=inscan", "--preset", "test", "--run-dir", str(run_dir), "--quiet"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["total_loss"]) and 0 <= r["hidden_zero_frac"] <= 1 for r in rows)
    assert rows[0]["llm_time_share"] is None and 0 < rows[1]["llm_time_share"] <= 1

    results = evaluate(run_dir, num_episodes=4, max_steps=8, modes=("real", "zeros", "noise", "shuffled"))
    assert set(results) == {"real", "zeros", "noise", "shuffled"}
    for r in results.values():
        assert r["episodes"] == 4 and np.isfinite(r["return_mean"])

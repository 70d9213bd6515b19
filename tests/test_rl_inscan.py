"""In-scan LLM hidden states: equal to the encoder called outside the scan; reset envs never keep a stale one."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import PRESETS, TrainConfig
from rl.llm import load_llm
from rl.trainer import RolloutCarry, Trainer

ENV = "Craftax-Classic-Symbolic-v1"


def _kill_env0(trainer, llm, runner):
    """Env 0 with zero health: it dies on its first step, so a reset happens inside a window; the window is
    re-opened on the changed states."""
    es = runner.env_state
    health = es.env_state.player_health.at[0].set(jnp.zeros((), es.env_state.player_health.dtype))
    es = es._replace(env_state=es.env_state.replace(player_health=health))
    hidden, window = trainer.encoder.open_window(llm.jit_args, es, jax.random.PRNGKey(7))
    return runner._replace(env_state=es, hidden=hidden, window=window)


def _rollout_fn(trainer):
    return jax.jit(lambda carry, r, args: trainer.rollout(r.params, carry, args, keep_states=True))


@pytest.fixture(scope="module")
def setup():
    """Zero-hidden reset policy, skip_n dividing num_steps (two windows per rollout)."""
    cfg = TrainConfig(**dict(PRESETS["test"], env=ENV, encoder="inscan", num_envs=4, num_steps=8, skip_n=4,
                             reset_hidden="zero"))
    llm = load_llm(cfg)
    trainer = Trainer.from_config(cfg, llm)
    runner = _kill_env0(trainer, llm, trainer.init_state(llm.jit_args))
    start = RolloutCarry(runner.env_state, runner.obs, runner.hidden, runner.rng, runner.window)
    carry, traj, info, states = _rollout_fn(trainer)(start, runner, llm.jit_args)
    return cfg, llm, runner, carry, traj, states


@pytest.fixture(scope="module")
def spanning(setup):
    """The pool reset policy with a window of 6 steps over two rollouts of 4: (cfg, llm, runner, carries,
    hidden [8, B, D], done [8, B], raw states [9, B] (step starts, then the end))."""
    _, llm, _, _, _, _ = setup
    cfg = TrainConfig(**dict(PRESETS["test"], env=ENV, encoder="inscan", num_envs=4, num_steps=4, skip_n=6,
                             reset_ratio=2))
    trainer = Trainer.from_config(cfg, llm)
    runner = _kill_env0(trainer, llm, trainer.init_state(llm.jit_args))
    rollout = _rollout_fn(trainer)
    carry = RolloutCarry(runner.env_state, runner.obs, runner.hidden, runner.rng, runner.window)
    carries, hidden, done, states = [], [], [], []
    for k in range(2):
        carry, traj, _, st = rollout(carry._replace(key=jax.random.PRNGKey(k)), runner, llm.jit_args)
        carries.append(carry)
        hidden.append(np.asarray(traj.hidden))
        done.append(np.asarray(traj.done))
        states.append(st)
    states.append(jax.tree.map(lambda x: x[None], carry.env_state.env_state))
    states = jax.tree.map(lambda *xs: jnp.concatenate(xs), *states)
    return cfg, llm, runner, carries, np.concatenate(hidden), np.concatenate(done), states


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
    np.testing.assert_allclose(np.asarray(carry.hidden), _outside(llm, cfg, carry.env_state.env_state), rtol=1e-5,
                               atol=1e-5)
    assert int(carry.window.clock) == cfg.skip_n  # a window ended on the last step: the next starts afresh
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


def test_window_spanning_two_rollouts_equals_step_by_step_reference(spanning):
    """Window 1 = steps 0-5 (rollout 1 and half of rollout 2), window 2 starts at step 6. At every step an env
    reads the LLM's vector of its state at the window start, or, after a reset inside the window, of the state
    its new episode started from (the window's pool world): each checked against the encoder called outside."""
    cfg, llm, runner, carries, hidden, done, states = spanning
    assert done[0, 0], "env 0 was given zero health and must end its episode on the first step"
    at = lambda t: jax.tree.map(lambda x: x[t], states)
    expect_cache = {}

    def outside(t):
        if t not in expect_cache:
            expect_cache[t] = _outside(llm, cfg, at(t))
        return expect_cache[t]

    resets_checked = 0
    for t in range(8):
        window_start = 0 if t < 6 else 6
        for i in range(cfg.num_envs):
            reset_steps = [s for s in range(window_start, t) if done[s, i]]
            source = reset_steps[-1] + 1 if reset_steps else window_start  # the state the reading is of
            np.testing.assert_allclose(hidden[t, i], outside(source)[i], rtol=1e-5, atol=1e-5, err_msg=str((t, i)))
            resets_checked += bool(reset_steps)
    assert resets_checked >= 5  # env 0, steps 1-5 at least
    assert not np.any(np.all(hidden == 0, axis=-1))  # hidden_zero_frac = 0: no zero vector ever acted on
    # env 0's new episode started in its block's pool world (drawn at the first window's start)
    np.testing.assert_array_equal(np.asarray(at(1).map[0]), np.asarray(runner.window.pool[1].map[0]))
    # clocks: 6 at the start, 2 left after rollout 1, the new window (from step 6) has 4 left after rollout 2
    assert [int(runner.window.clock)] + [int(c.window.clock) for c in carries] == [6, 2, 4]
    # the carried hidden state is the policy's input at the next step: window 2's reading of the step-6 states
    # (no env of the pair reset after step 6 here, else its pool reading)
    live = ~done[6:8].any(0)
    np.testing.assert_allclose(np.asarray(carries[1].hidden)[live], outside(6)[live], rtol=1e-5, atol=1e-5)


# A 6-step window over 4-step rollouts (3 updates): windows open at steps 0, 6 and 12, one of them across the stop
# of the resume test below. The README test's run is that test's uninterrupted run (one compile for both).
WINDOW_FLAGS = ["--encoder=inscan", "--preset", "test", "--num-steps", "4", "--skip-n", "6", "--reset-ratio", "2",
                "--total-timesteps", str(8 * 4 * 3), "--checkpoint-every", "5", "--quiet"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The run dir of `python -m rl.train` with WINDOW_FLAGS, uninterrupted."""
    from rl.train import main

    run_dir = tmp_path_factory.mktemp("inscan") / "full"
    assert main(WINDOW_FLAGS + ["--run-dir", str(run_dir)]) == 0
    return run_dir


def test_readme_main_command_with_test_preset(full_run):
    """The README's `python -m rl.train --encoder=inscan --preset cpu`, shrunk to the test preset (with the windows
    of WINDOW_FLAGS)."""
    from rl.eval import evaluate

    rows = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["total_loss"]) and 0 <= r["hidden_zero_frac"] <= 1 for r in rows)
    assert rows[0]["llm_time_share"] is None and 0 < rows[1]["llm_time_share"] <= 1

    results = evaluate(full_run, num_episodes=4, max_steps=8, modes=("real", "zero", "noise", "shuffled"))
    assert set(results) == {"real", "zero", "noise", "shuffled"}
    for r in results.values():
        assert r["episodes"] == 4 and np.isfinite(r["return_mean"])


def test_eval_prompt_variants_play_the_same_worlds(full_run, tmp_path, capsys):
    """`rl.eval --prompt/--prompts` (issue 36): each variant is a column beside `real` on the same worlds; a
    variant that repeats the run's own system prompt plays exactly `real`; eval.json names what the LLM read and
    carries the verdict."""
    from render.chat import default_system_prompt
    from rl.eval import main as eval_main

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    spec = tmp_path / "variants.yaml"
    spec.write_text("fixed: {game_text: Nothing to see.}\nno_inventory: {drop: inventory}\n")
    same = tmp_path / "same.txt"
    same.write_text(default_system_prompt(ENV, "compact"))
    rc = eval_main([str(run), "--episodes", "4", "--max-steps", "8", "--modes", "real", "--prompt", f"same=@{same}",
                    "--prompts", str(spec)])
    out = capsys.readouterr().out
    assert rc == 0 and "relies on the LLM' when the 95% paired-bootstrap interval" in out
    results = json.loads((run / "eval.json").read_text())
    assert list(results) == ["real", "same", "fixed", "no_inventory"]
    assert results["same"]["variant"]["system_prompt"] == same.read_text()
    assert results["fixed"]["variant"]["game_text"] == "Nothing to see."
    assert results["no_inventory"]["variant"]["dropped"] == ["inventory"]
    assert results["same"]["episode_returns"] == results["real"]["episode_returns"]
    assert results["same"]["vs_real"]["return_diff"] == 0.0 and "return_ci95" in results["real"]
    assert (run / "eval_ablations.png").exists()
    rc = eval_main([str(run), "--episodes", "4", "--prompt", "x=@/no/such/prompt.txt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no such file" in err[0]


def test_resume_restores_window_clock_and_hidden_exactly(full_run, tmp_path):
    """A 6-step window over 4-step rollouts, stopped after 2 of 3 updates (a window open across the stop: 4 of its 6
    steps left) and resumed, ends exactly like the uninterrupted run: params, hidden states, clock, reset pool."""
    from rl.config import load_config
    from rl.rundir import Checkpoints
    from rl.train import main

    assert main(WINDOW_FLAGS + ["--run-dir", str(tmp_path / "cut"), "--max-updates", "2"]) == 0
    assert main(["--resume", str(tmp_path / "cut"), "--quiet"]) == 0

    cfg = load_config(full_run / "config.json")
    llm = load_llm(cfg)
    target = Trainer.from_config(cfg, llm).init_state(llm.jit_args)
    finals = []
    for run_dir in (full_run, tmp_path / "cut"):
        ckpt = Checkpoints(run_dir)
        assert ckpt.latest_step() == 3
        finals.append(ckpt.restore(target, 3))
        ckpt.close()
    full, cut = finals
    # windows opened at steps 0, 6 and 12 (the last step): a resume that lost the clock (4 left at the stop)
    # would have opened its next window at step 14 instead
    assert int(full.window.clock) == int(cut.window.clock) == 6
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(cut)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(full) == jax.tree.structure(cut)


@pytest.mark.parametrize("reset_hidden", ["zero", "pool"])
def test_runner_shapes_skip_the_llm_but_equal_the_real_start(setup, reset_hidden):
    """`Trainer.runner_shapes` (what the update compiles ahead for) traces the first window on zeros instead of
    the LLM: its shapes, dtypes, weak types and shardings must equal those of the real `init_state`, else the
    update compiled ahead would not be the one the run calls. Its values never leak into the real start."""
    _, llm, runner, _, _, _ = setup
    cfg = TrainConfig(**dict(PRESETS["test"], env=ENV, encoder="inscan", num_envs=4, num_steps=8, skip_n=4,
                             reset_hidden=reset_hidden))
    trainer = Trainer.from_config(cfg, llm)
    fast = trainer.runner_shapes(llm.jit_args)
    real = jax.eval_shape(trainer.init_state, llm.jit_args)
    assert jax.tree.structure(fast) == jax.tree.structure(real)
    for a, b, sharding in zip(jax.tree.leaves(fast), jax.tree.leaves(real), jax.tree.leaves(real.shardings(
            trainer.mesh))):
        assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type)
        assert a.sharding == sharding
    if reset_hidden == "zero":  # the start after the shapes were traced still reads the LLM
        state = trainer.init_state(llm.jit_args)
        np.testing.assert_array_equal(np.asarray(state.hidden[1:]), np.asarray(runner.hidden[1:]))
        assert np.abs(np.asarray(state.hidden)).sum() > 0

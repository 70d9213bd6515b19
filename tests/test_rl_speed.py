"""The program-shape settings (`rl.config.SpeedConfig`) change the kernels, never the results: the same bits."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.config import TrainConfig, parse_xla_options
from rl.envs import BatchedEnv
from rl.unroll import count_scans, unroll_short_scans

CLASSIC = "Craftax-Classic-Symbolic-v1"
COMMAND_BUFFERS = "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"


def _same(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _dying_batch(env: BatchedEnv, dead: list[int]):
    """A reset batch whose envs `dead` die on their next step (health 0)."""
    _, state = jax.jit(env.reset)(jax.random.PRNGKey(0))
    es = state.env_state
    if dead:
        es = es.replace(player_health=es.player_health.at[jnp.array(dead)].set(0))
    return state._replace(env_state=es)


def test_unroll_short_scans_leaves_no_short_loop_and_the_same_bits():
    env = BatchedEnv(CLASSIC, 4)
    _, state = env.reset(jax.random.PRNGKey(0))
    raw = lambda k, s, a: jax.vmap(env.raw_env.step, in_axes=(0, 0, 0, None))(k, s, a, env.env_params)  # noqa: E731
    args = (jax.random.split(jax.random.PRNGKey(1), 4), state.env_state, jnp.arange(4) % env.num_actions)
    before = count_scans(raw, *args)
    assert before and max(before) > 4  # Craftax's step loops over its mob slots etc.
    after = count_scans(unroll_short_scans(raw, 4), *args)
    assert after == {n: k for n, k in before.items() if n > 4}
    assert unroll_short_scans(raw, 0) is raw


@pytest.mark.parametrize("dead", [[0, 2, 5], []], ids=["some-done", "none-done"])
def test_env_step_is_the_same_with_unrolled_scans_and_lazy_resets(dead):
    plain = BatchedEnv(CLASSIC, 8, reset_ratio=4)
    fast = BatchedEnv(CLASSIC, 8, reset_ratio=4, env_unroll=16, lazy_reset=True)
    state = _dying_batch(plain, dead)
    action = jnp.arange(8, dtype=jnp.int32) % plain.num_actions
    key = jax.random.PRNGKey(1)
    want = jax.jit(plain.step)(key, state, action)
    got = jax.jit(fast.step)(key, state, action)
    assert np.asarray(want[3]).sum() == len(dead)
    _same(want, got)
    _same(jax.jit(plain.reset)(key), jax.jit(fast.reset)(key))


def test_xla_options_parse_and_bad_ones_are_refused():
    assert parse_xla_options("") == {}
    assert parse_xla_options(f"{COMMAND_BUFFERS} xla_gpu_graph_min_graph_size=1 a=true") == {
        "xla_gpu_enable_command_buffer": COMMAND_BUFFERS.split("=", 1)[1], "xla_gpu_graph_min_graph_size": 1,
        "a": True}
    with pytest.raises(ValueError, match="name=value"):
        TrainConfig(trainer_xla="xla_gpu_enable_command_buffer").validate()
    with pytest.raises(ValueError, match="env-unroll"):
        TrainConfig(env_unroll=-2).validate()
    auto = TrainConfig().speed
    assert auto.env_unroll == -1 and auto.env_unroll_for(False, "gpu") == 12
    assert auto.env_unroll_for(True, "gpu") == 0 and auto.env_unroll_for(False, "cpu") == 0


@pytest.mark.slow
def test_training_metrics_are_bit_equal_with_every_speed_setting(tmp_path):
    """rl.train's records (timings aside) with all the settings on equal the defaults', bit for bit."""
    from rl.train import main

    def records(name, *flags):
        run = tmp_path / name
        assert main(["--preset", "test", "--reset-ratio", "4", "--run-dir", str(run), "--quiet", "--compile-cache",
                     "off", *flags]) == 0
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "sps")} for line in lines]

    base = records("base")
    fast = records("fast", "--env-unroll", "16", "--lazy-reset", "true", "--rollout-unroll", "2",
                   "--trainer-xla", COMMAND_BUFFERS)
    batched = records("batched", "--batch-resets", "true")
    assert len(base) == 3 and base == fast == batched
    saved = json.loads((tmp_path / "fast" / "config.json").read_text())
    assert saved["env_unroll"] == 16 and saved["lazy_reset"] is True


def test_rollout_with_batched_resets_is_the_same_as_drawing_each_step():
    """Envs that die on the first step restart in the worlds drawn before the scan: the same rollout, bit for bit."""
    from rl.llm import LLMArgs
    from rl.trainer import Trainer

    cfg = TrainConfig(encoder="none", env=CLASSIC, num_envs=8, reset_ratio=4, num_steps=4, num_minibatches=2,
                      update_epochs=1, width=32, total_timesteps=8 * 4 * 3)
    plain, fast = Trainer.from_config(cfg), Trainer.from_config(cfg.replace(batch_resets=True, rollout_unroll=2))
    state = plain.init_state()
    es = state.env_state.env_state
    dying = state.env_state._replace(env_state=es.replace(player_health=es.player_health.at[jnp.array([1, 6])].set(0)))
    carry = state.rollout_carry(jax.random.PRNGKey(3))._replace(env_state=dying)
    want = jax.jit(lambda c: plain.rollout(state.params, c, LLMArgs()))(carry)
    got = jax.jit(lambda c: fast.rollout(state.params, c, LLMArgs()))(carry)
    assert np.asarray(want[1].done)[0].sum() == 2
    _same(want, got)

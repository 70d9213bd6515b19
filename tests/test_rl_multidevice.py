"""Data-parallel training over several devices (fake CPU devices in subprocesses).

Two worker subprocesses run in parallel (this test process keeps its single device):
  * "equality" (4 fake devices): a tiny Classic `none` run on 4 devices vs the same global batch on 1
    device (same seed); an `inscan` tiny-Qwen run on 2 vs 1 device; the bad-input errors of Trainer;
    `ppo_update` alone (in a shard_map, as the trainer runs it) on synthetic data with each `shuffle`, 4 devices
    vs 1, and its compiled collectives.
  * "resume" (2 fake devices): an `inscan` tiny-moe (Qwen3-MoE) run on 2 vs 1 device; `python -m rl.train
    --devices 2` stopped after 2 of 3 updates and resumed, checked against the 1-device run of the "equality"
    worker; the checkpoint is restored sharded.
Run this file as a script (`python tests/test_rl_multidevice.py WORKER OUT_DIR`) to run one worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The "none" run: 8 envs x 8 steps, 3 updates; reset_ratio 2: each of 4 devices holds one block of 2 envs.
NONE_RUN = dict(encoder="none", total_timesteps=8 * 8 * 3, reset_ratio=2)
# The "inscan" run: 2 updates of 4 steps with one LLM window of 6 steps spanning them; each of 2 devices holds one
# reset block of 2 envs and its window's pool world.
INSCAN_RUN = dict(encoder="inscan", num_envs=4, num_steps=4, skip_n=6, reset_ratio=2, total_timesteps=4 * 4 * 2)
# Float reassociation of the gradient all-reduce and of sums over the env axis: a few ulps per update.
RTOL, ATOL = 1e-4, 1e-6
# The synthetic PPO update: T x B samples with an obs feature size seen nowhere else in its HLO.
PPO_T, PPO_B, PPO_OBS = 8, 8, 37
# The workers' time is nearly all compiling (8 envs, a few steps): LLVM optimisation level 0 compiles Craftax's env
# programs in ~40-60% of the CPU time of the default level (measured 2026-11-27, CPU seconds: Classic BatchedEnv
# reset 4.6 vs 10.8, step 19.0 vs 31.2, render.sample_states 30 vs 51). The HLO (fusions, collectives) is the same;
# float rounding may differ (env states were bit-identical over 6 steps, the synthetic PPO update's params ~1e-6
# apart), and every comparison here is between programs compiled with the same flags. tests/test_rl_multihost.py uses
# the same flags (its 2-device reference shares the resume worker's compile through the persistent cache, whose key
# includes XLA_FLAGS).
WORKER_XLA_FLAGS = "--xla_backend_optimization_level=0"


# ---------------------------------------------------------------------------------------------------------
# workers (run in subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=N)
def _config(devices: int, **fields):
    from rl.config import PRESETS, TrainConfig

    return TrainConfig(**dict(PRESETS["test"], devices=devices, **fields))


def _train(cfg, llm=None):
    """Run all updates of `cfg` in process; returns (final runner, metrics per update)."""
    from rl.trainer import Trainer

    trainer = Trainer.from_config(cfg, llm)
    llm_args = trainer.place_llm_args(llm.jit_args if llm is not None else (None, None))
    runner = trainer.init_state(llm_args)
    metrics = []
    for _ in range(cfg.num_updates):
        runner, m = trainer.step(runner, llm_args)
        metrics.append({k: np.asarray(v).tolist() for k, v in m.items()})
    return trainer, runner, metrics


def _save(out: Path, name: str, params, metrics, **extra) -> None:
    import jax

    leaves = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(jax.device_get(params)))}
    np.savez(out / f"{name}_params.npz", **leaves)
    (out / f"{name}.json").write_text(json.dumps(dict(metrics=metrics, **extra)))


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _ppo_update_on_devices(out: Path) -> None:
    """`ppo_update` (tiny MLP, synthetic rollout split over the env axis) for each shuffle on 1 and 4
    devices: params, and the shapes of the compiled 4-device update's all-gathers."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from rl.networks import ActorCritic
    from rl.ppo import SHUFFLES, PPOHyper, Transition, make_optimizer, ppo_update
    from rl.sharding import ENV_AXIS, make_mesh

    k = jax.random.split(jax.random.PRNGKey(0), 7)
    shape, actions = (PPO_T, PPO_B), 5
    traj = Transition(jax.random.normal(k[0], shape + (PPO_OBS,)), None, jax.random.randint(k[1], shape, 0, actions),
                      -jnp.log(actions) + 0.1 * jax.random.normal(k[2], shape), jax.random.normal(k[3], shape),
                      jax.random.normal(k[4], shape), jax.random.uniform(k[5], shape) < 0.2)
    last_value = jax.random.normal(k[6], (PPO_B,))
    net = ActorCritic(num_actions=actions, width=16)
    params = net.init(jax.random.PRNGKey(1), jnp.zeros((1, PPO_OBS)))
    optimizer = make_optimizer(1e-3, 100)
    gathers = {}
    for shuffle in SHUFFLES:
        hp = PPOHyper(update_epochs=2, num_minibatches=4, shuffle=shuffle)
        for devices in (1, 4):
            mesh = make_mesh(devices)
            local = PPO_B // devices

            def update(p, s, tr, lv, key):  # as the trainer runs it: one device's envs, global env indices
                env_index = jax.lax.axis_index(ENV_AXIS) * local + jnp.arange(local)
                return ppo_update(p, s, optimizer, net.apply, tr, lv, key, hp, axis_name=ENV_AXIS, env_index=env_index)

            update = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), P(), P(None, ENV_AXIS), P(ENV_AXIS), P()),
                                           out_specs=P(), check_vma=False))
            args = (params, optimizer.init(params), traj, last_value, jax.random.PRNGKey(2))
            compiled = update.lower(*args).compile()
            new_params, _, metrics = compiled(*args)
            _save(out, f"ppo_{shuffle}_{devices}", new_params,
                  [{name: np.asarray(v).tolist() for name, v in metrics.items()}])
            if devices > 1:  # e.g. "%all-gather.6 = f32[8,8,37]{2,0,1} all-gather(%copy), ..."
                hlo = compiled.as_text()
                find = lambda text: re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", text)
                gathers[shuffle] = find(hlo)
                entry = hlo[hlo.index("ENTRY"):]
                gathers[shuffle + "_outside_loops"] = find(entry[: entry.index("\n}")])  # not in a while body
                gathers[shuffle + "_all_reduces"] = len(re.findall(r" all-reduce(?:-start)?\(", hlo))
    (out / "ppo_gathers.json").write_text(json.dumps(gathers))


def _env_steps_on_devices(out: Path) -> None:
    """One `BatchedEnv.step` with five forced deaths: the whole batch on one device vs a shard_map over 4
    devices (2 envs each), for reset blocks smaller than, equal to and larger than a device's share."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from rl.envs import BatchedEnv
    from rl.sharding import ENV_AXIS, make_mesh

    mismatches = {}
    for reset_ratio in (1, 2, 4, 8):
        env = BatchedEnv("Craftax-Classic-Symbolic-v1", num_envs=8, reset_ratio=reset_ratio)
        _, state = jax.jit(env.reset)(jax.random.PRNGKey(0))
        es = state.env_state
        state = state._replace(env_state=es.replace(player_health=es.player_health.at[jnp.array([0, 1, 2, 5, 6])].set(0)))
        action, key = jnp.zeros(8, jnp.int32), jax.random.PRNGKey(1)
        whole = jax.jit(env.step)(key, state, action)

        def local_step(k, s, a):
            return env.step(k, s, a, jax.lax.axis_index(ENV_AXIS) * 2 + jnp.arange(2))

        split = jax.jit(jax.shard_map(local_step, mesh=make_mesh(4), in_specs=(P(), P(ENV_AXIS), P(ENV_AXIS)),
                                      out_specs=P(ENV_AXIS), check_vma=False))(key, state, action)
        assert int(whole[3].sum()) == 5  # the five envs died and were reset
        mismatches[reset_ratio] = sum(not np.array_equal(np.asarray(a), np.asarray(b))
                                      for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)))
    (out / "env_steps.json").write_text(json.dumps(mismatches))


class _FakeVLLM:
    """A deterministic stand-in for the vLLM server: a hidden state computed from the prompt ids."""

    seconds = 0.0

    def __call__(self, ids, lengths):
        ids, lengths = np.asarray(ids), np.asarray(lengths)
        total = (ids.astype(np.float64) * (np.arange(ids.shape[1]) < lengths[:, None])).sum(1)
        return np.sin(total[:, None] * (1 + np.arange(16)) * 1e-3).astype(np.float32)


def worker_equality(out: Path) -> None:
    import jax

    from rl.trainer import Trainer

    assert jax.device_count() == 4
    _ppo_update_on_devices(out)
    _env_steps_on_devices(out)
    for devices in (1, 4):
        trainer, runner, metrics = _train(_config(devices, **NONE_RUN))
        _save(out, f"none_{devices}", runner.params, metrics, obs_devices=len(runner.obs.sharding.device_set),
              obs_shard_rows=[s.data.shape[0] for s in runner.obs.addressable_shards])
    errors = {
        "too_many": _error_of(lambda: Trainer.from_config(_config(8, **NONE_RUN))),
        "envs_split": _error_of(lambda: Trainer.from_config(_config(4, **dict(NONE_RUN, num_envs=6, total_timesteps=6 * 8)))),
        "pool_split": _error_of(lambda: Trainer.from_config(_config(4, **dict(NONE_RUN, reset_ratio=3)))),  # blocks of 3, 2 envs a device
        # 2 steps x 8 envs / 8 minibatches = 2 samples a minibatch: the global shuffle cannot share it over 4 devices
        "minibatch_split": _error_of(lambda: Trainer.from_config(_config(4, **dict(NONE_RUN, num_steps=2, num_minibatches=8,
                                                                       update_epochs=1, total_timesteps=16)))),
    }
    (out / "errors.json").write_text(json.dumps(errors))

    from rl.llm import load_llm

    llm = None
    for devices in (1, 2):
        cfg = _config(devices, **INSCAN_RUN)
        llm = llm or load_llm(cfg)
        _, runner, metrics = _train(cfg, llm)
        _save(out, f"inscan_{devices}", runner.params, metrics, hidden=np.asarray(runner.hidden).tolist(),
              pool_hidden=np.asarray(runner.window.pool_hidden).tolist(), clock=int(runner.window.clock))
    for devices in (1, 4):  # the vllm path: host loop over windows, PPO step in its own shard_map
        cfg = _config(devices, **dict(NONE_RUN, encoder="vllm", total_timesteps=8 * 8 * 2))
        _, runner, metrics = _train_vllm(cfg)
        _save(out, f"vllm_{devices}", runner.params, metrics, obs_devices=len(runner.obs.sharding.device_set))


def _train_vllm(cfg):
    from rl.llm import load_llm
    from rl.trainer import Trainer

    trainer = Trainer.from_config(cfg, load_llm(cfg, with_model=False), _FakeVLLM())
    runner = trainer.init_state()
    metrics = []
    for _ in range(cfg.num_updates):
        runner, m = trainer.step(runner)
        metrics.append({k: np.asarray(v).tolist() for k, v in m.items()})
    return trainer, runner, metrics


def _moe_on_devices(out: Path) -> None:
    """The in-scan run with Qwen3-MoE (`tiny-moe`) on 1 and 2 devices: the whole model on each (issue 33,
    `--devices 2`), the env batch split."""
    from rl.llm import load_llm

    llm = None
    for devices in (1, 2):
        cfg = _config(devices, **dict(INSCAN_RUN, model="tiny-moe"))
        llm = llm or load_llm(cfg)
        assert llm.model.config.is_moe
        _, runner, metrics = _train(cfg, llm)
        _save(out, f"moe_{devices}", runner.params, metrics, hidden=np.asarray(runner.hidden).tolist(),
              obs_devices=len(runner.obs.sharding.device_set))


def worker_resume(out: Path) -> None:
    import jax

    from rl.config import load_config
    from rl.rundir import Checkpoints
    from rl.train import main
    from rl.trainer import Trainer

    assert jax.device_count() == 2
    _moe_on_devices(out)
    run_dir = out / "run2"
    flags = ["--preset", "test", "--devices", "2", "--quiet", "--checkpoint-every", "1"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in NONE_RUN.items()]
    assert main(flags + ["--run-dir", str(run_dir), "--max-updates", "2"]) == 0
    assert main(["--resume", str(run_dir), "--quiet"]) == 0
    cfg = load_config(run_dir / "config.json")
    trainer = Trainer.from_config(cfg)
    ckpt = Checkpoints(run_dir)
    runner = ckpt.restore(trainer.init_state(), ckpt.latest_step())
    ckpt.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    _save(out, "resumed_2", runner.params, metrics, config_devices=cfg.devices, update=int(runner.update),
          obs_devices=len(runner.obs.sharding.device_set),
          env_state_devices=len(jax.tree.leaves(runner.env_state)[0].sharding.device_set))


WORKERS = {"equality": (worker_equality, 4), "resume": (worker_resume, 2)}


# ---------------------------------------------------------------------------------------------------------
# tests (main process, one device)
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run both workers at once; returns the folder with their outputs."""
    out = tmp_path_factory.mktemp("multidevice")
    procs = {}
    for name, (_, devices) in WORKERS.items():
        xla_flags = f"--xla_force_host_platform_device_count={devices} {WORKER_XLA_FLAGS}"
        env = dict(os.environ, XLA_FLAGS=xla_flags,
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   JAX_PLATFORMS="cpu")
        procs[name] = subprocess.Popen([sys.executable, __file__, name, str(out)], env=env, cwd=out,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=1500)  # a hang guard: ~7 min beside another pytest worker on 2 cores
        assert proc.returncode == 0, f"worker {name} failed:\n{log[-6000:]}"
    return out


def _load(out: Path, name: str):
    params = np.load(out / f"{name}_params.npz")
    return [params[f"p{i}"] for i in range(len(params.files))], json.loads((out / f"{name}.json").read_text())


def _numbers(v):
    """A metric as numbers: metrics.jsonl writes achievements as a dict and NaN as null."""
    v = list(v.values()) if isinstance(v, dict) else v
    return np.nan if v is None else v


def _assert_same_run(out: Path, a: str, b: str, skip=("sps", "seconds", "llm_time_share",
                                                          "first_call_includes_compile", "update", "timestep")):
    pa, ma = _load(out, a)
    pb, mb = _load(out, b)
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)
    assert len(ma["metrics"]) == len(mb["metrics"])
    for ra, rb in zip(ma["metrics"], mb["metrics"]):
        keys = [k for k in ra if k not in skip]
        assert keys and set(keys) <= set(rb)
        for k in keys:
            x, y = (np.asarray(_numbers(r[k]), float) for r in (ra, rb))
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=k)
    return ma, mb


def test_four_devices_equal_one_device(results):
    m1, m4 = _assert_same_run(results, "none_1", "none_4")
    assert m4["obs_devices"] == 4 and m4["obs_shard_rows"] == [2, 2, 2, 2]  # really split: 8 envs, 2 per device
    assert m1["obs_devices"] == 1


def test_inscan_two_devices_equal_one_device(results):
    _, m2 = _assert_same_run(results, "inscan_1", "inscan_2")
    _, m1 = _load(results, "inscan_1")
    np.testing.assert_allclose(np.asarray(m1["hidden"]), np.asarray(m2["hidden"]), rtol=1e-4, atol=1e-4)
    # the window (6 steps) began at step 6 of 8, inside the second rollout; its pool: one world per block of 2 envs
    assert m1["clock"] == m2["clock"] == 4
    np.testing.assert_allclose(np.asarray(m1["pool_hidden"]), np.asarray(m2["pool_hidden"]), rtol=1e-4, atol=1e-4)
    assert np.asarray(m1["pool_hidden"]).shape[0] == 2


def test_moe_inscan_two_devices_equal_one_device(results):
    """Qwen3-MoE (`tiny-moe`) in the scan, data parallel: 2 devices, each holding the whole model, train as 1 does."""
    _, m2 = _assert_same_run(results, "moe_1", "moe_2")
    _, m1 = _load(results, "moe_1")
    assert m2["obs_devices"] == 2 and m1["obs_devices"] == 1
    np.testing.assert_allclose(np.asarray(m1["hidden"]), np.asarray(m2["hidden"]), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(m1["hidden"])).max() > 0


def test_vllm_path_four_devices_equal_one_device(results):
    _, m4 = _assert_same_run(results, "vllm_1", "vllm_4")
    assert m4["obs_devices"] == 4


def test_env_step_split_over_devices_equals_whole_batch(results):
    assert json.loads((results / "env_steps.json").read_text()) == {"1": 0, "2": 0, "4": 0, "8": 0}


def test_ppo_update_four_devices_equal_one_device(results):
    for shuffle in ("global", "per_env"):
        _assert_same_run(results, f"ppo_{shuffle}_1", f"ppo_{shuffle}_4")
    p_global, _ = _load(results, "ppo_global_1")
    p_per_env, _ = _load(results, "ppo_per_env_1")
    assert not all(np.allclose(x, y) for x, y in zip(p_global, p_per_env))  # the option really changes minibatches


def test_per_env_shuffle_keeps_the_rollout_split(results):
    """The compiled 4-device update: the global shuffle all-gathers the rollout obs [T, B, O] once (outside the
    epoch loop); per_env gathers nothing of obs size (only statistics, losses and gradients are all-reduced)."""
    gathers = json.loads((results / "ppo_gathers.json").read_text())
    has_obs = lambda dims: str(PPO_OBS) in dims.split(",")
    assert any(has_obs(d) for d in gathers["global"]), gathers["global"]
    # once per update: every obs-sized gather sits in the entry computation, none in the epoch/minibatch loops
    assert [d for d in gathers["global"] if has_obs(d)] == [d for d in gathers["global_outside_loops"] if has_obs(d)]
    assert not any(has_obs(d) for d in gathers["per_env"]), gathers["per_env"]
    assert gathers["per_env_all_reduces"] > 0


def test_resumed_two_device_run_equals_one_device_run(results):
    _, m2 = _assert_same_run(results, "none_1", "resumed_2")
    assert m2["config_devices"] == 2 and m2["update"] == 3
    assert m2["obs_devices"] == 2 and m2["env_state_devices"] == 2  # orbax restored the arrays sharded


def test_bad_device_counts_give_clear_errors(results):
    errors = json.loads((results / "errors.json").read_text())
    assert "--devices 8 but only 4 cpu device(s) are visible" in errors["too_many"]
    assert "--num-envs 6 does not split over 4 devices" in errors["envs_split"]
    assert "optimistic-reset pool" in errors["pool_split"] and "--reset-ratio" in errors["pool_split"]
    assert "does not split over 4 devices" in errors["minibatch_split"] and "per_env" in errors["minibatch_split"]


def test_resume_on_fewer_devices_is_refused(results, capsys):
    from rl.train import main

    assert main(["--resume", str(results / "run2"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "trained on 2 devices" in err and "only 1 cpu device(s) are visible" in err


def test_device_checks_without_devices():
    """The pure checks, and the multi-host env-var parsing (no initialisation happens on bad input)."""
    from rl.config import TrainConfig
    from rl.sharding import maybe_initialize_distributed

    def check_divisible(num_envs, reset_ratio, devices):
        TrainConfig(num_envs=num_envs, reset_ratio=reset_ratio, num_steps=1, num_minibatches=1, update_epochs=1,
                    total_timesteps=num_envs, shuffle="per_env").validate(devices)

    check_divisible(1024, 16, 4)
    with pytest.raises(ValueError, match="--num-envs 10 does not split over 4 devices"):
        check_divisible(10, 1, 4)
    check_divisible(64, 32, 4)  # 16 envs a device, each inside a block of 32
    check_divisible(8, 16, 2)
    with pytest.raises(ValueError, match="reset-ratio"):
        check_divisible(96, 16, 4)  # 24 envs a device: one and a half blocks
    assert maybe_initialize_distributed({}) is False
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID not set"):
        maybe_initialize_distributed({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID 2 must be in"):
        maybe_initialize_distributed({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                                      "JAX_PROCESS_ID": "2"})


if __name__ == "__main__":
    worker, out_dir = sys.argv[1], Path(sys.argv[2])
    import jax

    cache = os.environ["JAX_TEST_CACHE_DIR"]  # set by tests/conftest.py
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    WORKERS[worker][0](out_dir)

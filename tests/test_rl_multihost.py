"""Multi-host training on one machine: 2 `python -m rl.train` processes on CPU (1 fake device each, gloo
collectives, `jax.distributed` via JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID), checked
against a 1-process run of the same global batch on 2 fake devices.

The 2-process run stops after 2 updates (`--max-updates`) and is finished by a 2-process `--resume`, so the
collective orbax save and restore are exercised too. Only the main process may write config.json,
metrics.jsonl and progress lines. Compared: every leaf of the final checkpointed state (params, optimizer
state, env states, obs, PRNG key), and every metric of every update.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Same flags as test_rl_multidevice's 2-device resume worker (so the reference compile is shared through the
# persistent cache): 8 envs x 8 steps, 3 updates, reset blocks of 2 envs (2 blocks per device).
RUN_FLAGS = ["--preset", "test", "--encoder", "none", "--total-timesteps", str(8 * 8 * 3), "--reset-ratio", "2",
             "--checkpoint-every", "1", "--devices", "2"]
UPDATES = 3
# Float reassociation of the gradient all-reduce (gloo vs in-process) and of sums over the env axis.
RTOL, ATOL = 1e-4, 1e-6
TIMEOUT_S = 300
# test_rl_multidevice's WORKER_XLA_FLAGS (why: there); the same, so that the reference shares its compile.
PROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0"
NOT_COMPARED = ("sps", "seconds", "first_call_includes_compile")


def _env(devices_per_process: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_TEST_CACHE_DIR"}
    cache = os.environ["JAX_TEST_CACHE_DIR"]  # set by tests/conftest.py
    xla_flags = f"--xla_force_host_platform_device_count={devices_per_process} {PROCESS_XLA_FLAGS}"
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", **extra)
    return env


class Launcher:
    """Starts `python -m rl.train` processes with their output in log files; `wait` fails the test with
    every log's tail if one exits non-zero or the time runs out (then it kills the ones still running)."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "rl.train", *args], cwd=self.logs, env=env,
                                            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def start_pair(self, name: str, args: list[str], port: int) -> None:
        """Two processes of one distributed run (1 CPU device each, coordinator on localhost:port)."""
        for pid in (0, 1):
            self.start(f"{name}{pid}", args, _env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                  JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid)))

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def wait(self, *names: str, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        pending = set(names)
        failed = None
        while pending and failed is None and time.monotonic() < deadline:
            for name in sorted(pending):
                rc = self.procs[name].poll()
                if rc is not None:
                    pending.discard(name)
                    failed = failed or (f"{name} exited with {rc}" if rc else None)
            time.sleep(0.2)
        if pending or failed:
            for name in pending:  # a peer of a failed process would wait for it until jax's heartbeat timeout
                self.procs[name].kill()
                self.procs[name].wait()
            why = failed or f"{sorted(pending)} still running after {timeout:.0f} s"
            tails = "\n".join(f"--- {n}.log ---\n{self.log(n)[-4000:]}" for n in names)
            pytest.fail(f"{why}\n{tails}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, free_port):
    """A 2-process run (2 updates, then a 2-process --resume for the 3rd) and the 1-process reference,
    the first pair and the reference launched at the same time."""
    out = tmp_path_factory.mktemp("multihost")
    launcher = Launcher(out)
    launcher.start_pair("first", RUN_FLAGS + ["--run-dir", str(out / "multi"), "--max-updates", "2"], free_port())
    launcher.start("reference", RUN_FLAGS + ["--run-dir", str(out / "single"), "--quiet"], _env(2))
    launcher.wait("first0", "first1")
    launcher.start_pair("resume", ["--resume", str(out / "multi")], free_port())
    launcher.wait("resume0", "resume1", "reference")
    return out, launcher


def _restore_all_leaves(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """Every array of a checkpointed RunnerState, restored onto this process's one device, by tree path."""
    import jax
    import orbax.checkpoint as ocp

    path = (run_dir / "checkpoints" / str(step) / "default").resolve()
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            checkpointer.metadata(path).item_metadata)
    state = checkpointer.restore(path, abstract)
    checkpointer.close()
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _numbers(v):
    """A metric as numbers: metrics.jsonl writes achievements as a dict and NaN as null."""
    v = list(v.values()) if isinstance(v, dict) else v
    return np.nan if v is None else v


def test_two_processes_equal_one_process_on_two_devices(runs):
    out, _ = runs
    multi, single = _restore_all_leaves(out / "multi", UPDATES), _restore_all_leaves(out / "single", UPDATES)
    assert multi.keys() == single.keys() and any("params" in k for k in multi)
    for key in multi:
        np.testing.assert_allclose(multi[key], single[key], rtol=RTOL, atol=ATOL, err_msg=key)
    assert int(multi["['update']"]) == UPDATES
    assert multi["['obs']"].shape[0] == 8  # the global batch was saved, not one process's half

    m_multi, m_single = _metrics(out / "multi"), _metrics(out / "single")
    assert [r["update"] for r in m_multi] == list(range(1, UPDATES + 1))  # one line per update: no duplicates
    for a, b in zip(m_multi, m_single):
        assert set(a) - set(NOT_COMPARED) == set(b) - set(NOT_COMPARED)
        for k in set(a) - set(NOT_COMPARED):
            x, y = (np.asarray(_numbers(r[k]), float) for r in (a, b))
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=f"update {a['update']} {k}")


def test_only_process_zero_writes_and_prints(runs):
    out, launcher = runs
    config = json.loads((out / "multi" / "config.json").read_text())
    assert config["devices"] == 2 and config["run_dir"] == str(out / "multi")
    assert sorted(p.name for p in (out / "multi").iterdir()) == ["checkpoints", "config.json", "metrics.jsonl"]
    assert sorted(p.name for p in (out / "multi" / "checkpoints").iterdir()) == ["2", "3"]  # keep_checkpoints=2
    first0, first1, resume0, resume1 = (launcher.log(n) for n in ("first0", "first1", "resume0", "resume1"))
    assert "[update 1/3]" in first0 and "[update 2/3]" in first0 and "stopped at update 2/3" in first0
    assert "resuming" in resume0 and "[update 3/3]" in resume0 and "finished 3 updates" in resume0
    for log in (first1, resume1):
        assert "[update" not in log and "resuming" not in log and "stopped" not in log and "finished" not in log


def test_metrics_log_of_other_processes_writes_nothing(tmp_path):
    from rl.rundir import MetricsLog

    MetricsLog(tmp_path / "m.jsonl").append({"update": 1})
    quiet = MetricsLog(tmp_path / "m.jsonl", writable=False)
    quiet.append({"update": 2})
    quiet.truncate_after(0)
    assert quiet.read() == [{"update": 1}]

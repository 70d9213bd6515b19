"""The user's own command, `python -m rl.train`, as timed subprocesses: its steady-state speed from its metrics.jsonl.

`scripts/bench_reference.py --rl-train` puts these numbers beside the upstream `ppo.py` and the in-process harness.
Every (config, variant) is a `TrainJob`: the rl.train flags of a config (`config_flags`) plus a variant's extra flags
(e.g. `--lazy-reset true`). `Warmup` runs each job once (`--max-updates 1`) in the background, several at a time,
so that every program lands in one persistent compilation cache while the caller compiles its own; `time_job` then
runs a job alone with the warm cache and reads its records (`steady_state`: the median over the updates after
`skip`). A record's `seconds` is its own update's time (`rl.loop.ReadyTime`), so the median is what a user sees.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
# settings that decide what an update computes; the rest keep rl.train's defaults
CONFIG_FIELDS = ("env", "seed", "num_envs", "reset_ratio", "num_steps", "total_timesteps", "update_epochs",
                 "num_minibatches", "width")


@dataclass(frozen=True)
class TrainJob:
    """One rl.train command line: `config` (a bench config name) run as `variant` with `flags`."""

    config: str
    variant: str
    flags: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.config}.{self.variant}"


def config_flags(cfg: Any) -> list[str]:
    """rl.train flags that give the update of TrainConfig `cfg` (plain PPO)."""
    flags = ["--encoder", "none"]
    for field in CONFIG_FIELDS:
        flags += [f"--{field.replace('_', '-')}", str(getattr(cfg, field))]
    return flags


@dataclass(frozen=True)
class Variant:
    """Extra rl.train `flags` under a `name`, for the bench configs `configs` (empty: every config)."""

    name: str
    flags: tuple[str, ...] = ()
    configs: tuple[str, ...] = ()

    def applies_to(self, config: str) -> bool:
        return not self.configs or config in self.configs


def parse_variants(specs: Sequence[str]) -> list[Variant]:
    """["NAME[@CONFIG,CONFIG]=--flag value ...", ...] -> variants; "default" (no extra flags) always comes first."""
    variants = [Variant("default")]
    for spec in specs:
        head, sep, flags = spec.partition("=")
        name, _, configs = head.partition("@")
        if not sep or not name.strip():
            raise ValueError(f"variant {spec!r} is not NAME[@CONFIGS]=FLAGS (e.g. lazy=--lazy-reset true)")
        variants.append(Variant(name.strip(), tuple(flags.split()), tuple(c for c in configs.split(",") if c)))
    return variants


def command(job: TrainJob, run_dir: Path, updates: int, cache: Path) -> list[str]:
    """The rl.train command line of `job`: `updates` updates into `run_dir`, compiled programs kept in `cache`."""
    return [sys.executable, "-m", "rl.train", *job.flags, "--max-updates", str(updates), "--run-dir", str(run_dir),
            "--quiet", "--compile-cache", str(cache)]


def _environ() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_job(job: TrainJob, workdir: Path, tag: str, updates: int, cache: Path, timeout: float) -> dict:
    """Run `job` for `updates` updates in workdir/<job>.<tag>; -> {rc, wall_s, run_dir, log} (rc None: timed out)."""
    run_dir = workdir / f"{job.name}.{tag}"
    log = workdir / f"{job.name}.{tag}.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(command(job, run_dir, updates, cache), cwd=ROOT, env=_environ(), stdout=out,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return dict(rc=rc, wall_s=time.perf_counter() - t0, run_dir=run_dir, log=log)


def read_records(run_dir: Path) -> list[dict]:
    """The metrics.jsonl records of a run directory (none if it has no file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steady_state(records: Sequence[dict], skip: int) -> dict:
    """Steady-state speed from rl.train records: the median SPS and seconds over the updates after `skip` (the first
    record, which compiles, is always left out), and the SPS of their total time."""
    later = [r for r in records if r["update"] > skip and not r.get("first_call_includes_compile")]
    if not later:
        later = [r for r in records if not r.get("first_call_includes_compile")]
    if not later:
        return dict(updates=0)
    seconds = [r["seconds"] for r in later]
    steps = sum(r["sps"] * r["seconds"] for r in later)
    return dict(updates=len(later), sps=statistics.median(r["sps"] for r in later),
                seconds=statistics.median(seconds), sps_total=steps / sum(seconds), seconds_all=seconds)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def time_job(job: TrainJob, workdir: Path, cache: Path, updates: int, skip: int, timeout: float) -> dict:
    """`job` alone for `updates` updates: its steady state (`steady_state`), wall time and first record's seconds."""
    res = run_job(job, workdir, "timed", updates, cache, timeout)
    records = read_records(res["run_dir"])
    row = dict(steady_state(records, skip), rc=res["rc"], wall_s=res["wall_s"],
               first_update_s=records[0]["seconds"] if records else None)
    if res["rc"] != 0 or not records:
        row["error"] = _tail(res["log"])
    return row


class Warmup:
    """Every job once (`--max-updates 1`), at most `workers` at a time, in the background: their programs are
    compiled into `cache` while the caller does something else. `wait()` -> {job name: {rc, wall_s}}."""

    def __init__(self, jobs: Sequence[TrainJob], workdir: Path, cache: Path, workers: int, timeout: float) -> None:
        self.results: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="rl-train-warmup")
        self._futures = [self._pool.submit(self._one, job, workdir, cache, timeout) for job in jobs]

    def _one(self, job: TrainJob, workdir: Path, cache: Path, timeout: float) -> None:
        res = run_job(job, workdir, "warmup", 1, cache, timeout)
        entry = dict(rc=res["rc"], wall_s=res["wall_s"])
        if res["rc"] != 0:
            entry["error"] = _tail(res["log"])
        with self._lock:
            self.results[job.name] = entry
        print(f"  warm-up {job.name}: rc {res['rc']}, {res['wall_s']:.1f} s", flush=True)

    def wait(self) -> dict[str, dict]:
        for f in self._futures:
            f.result()
        self._pool.shutdown()
        return dict(self.results)

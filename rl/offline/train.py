"""`python -m rl.offline train`: offline AWR on trajectory files, the dataset on the device, checkpoints with
the normalisation statistics inside, an exact `--resume`.

The loop dispatches chunks of `updates_per_dispatch` updates (one `lax.scan` each, `rl.offline.update`), cut
at every log, checkpoint and shard boundary (absolute update numbers, so a resumed run cuts where the
uninterrupted one did); metrics are read only at log boundaries, so the device runs ahead of the host.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl.files import atomic_write
from rl.offline import data as D
from rl.offline.config import KIND, RESUME_MUTABLE, OfflineConfig, config_of, read_run_config
from rl.offline.networks import AWRNetwork
from rl.offline.shards import ResidentShards, StreamedShards, device_limit_bytes, pad_rows
from rl.offline.update import init_state, make_train_chunk, make_validation
from rl.rundir import Checkpoints, MetricsLog
from rl.settings import resume_differences
from rl.trajectories import TrajectoryError

VAL_BATCH = 1024


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@dataclass
class Prepared:
    """What the data gives a run: the files, per-row targets, split, layout and hidden statistics."""

    plan: D.Plan
    train: list[int]
    val: list[int]
    layout: D.Layout
    stats: dict | None
    digest: str
    hidden_layer: int | None = None  # --hidden-layer (None: the files' first labelled layer)

    @property
    def env(self) -> str:
        return self.plan.files[0].env

    @property
    def hidden_size(self) -> int | None:
        return self.plan.files[0].hidden_dim

    @property
    def labelling(self) -> dict | None:
        """The files' labelling; with several labelled layers, `llm_layer` says the one this run reads."""
        lab = self.plan.files[0].labelling
        if lab and self.hidden_layer is not None:
            lab = dict(lab, llm_layer=int(self.hidden_layer))
        return lab


def data_digest(files: list[D.FileInfo]) -> str:
    """A fingerprint of the dataset (file names, sizes and sample counts): --resume refuses changed data."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path.name):
        h.update(f"{f.path.name}:{f.path.stat().st_size}:{f.samples}\n".encode())
    return h.hexdigest()[:16]


def prepare(cfg: OfflineConfig, say: Callable[[str], None] = _stderr) -> Prepared:
    """Read and check the files, compute targets, split, scan the values (layout, statistics)."""
    files = D.scan(cfg.data, file_envs=cfg.file_envs, need_hidden=cfg.uses_hidden, hidden_layer=cfg.hidden_layer)
    pl = D.plan(files, cfg.gamma, cfg.hidden_skip_n)
    if pl.truncated:
        say(f"warning: {pl.truncated:,} of {pl.rows:,} samples have a truncated return-to-go (no episode end "
            f"follows them in their env's stream before a gap or the end of the data)")
    train, val = D.split_files(files, cfg.val_fraction)
    layout, stats = D.scan_values(pl, train, cfg.uses_hidden)
    return Prepared(pl, train, val, layout, stats, data_digest(files), cfg.hidden_layer if cfg.uses_hidden else None)


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def run_config(cfg: OfflineConfig, prep: Prepared, num_actions: int) -> dict[str, Any]:
    """config.json of the run: its kind, settings and what it learned from the data (CONTRACTS.md)."""
    pl = prep.plan
    return {"kind": KIND, "settings": cfg.to_json(), "env": prep.env, "obs_size": prep.layout.obs_size,
            "num_actions": num_actions, "hidden_size": prep.hidden_size if cfg.uses_hidden else None,
            "labelling": prep.labelling if cfg.uses_hidden else None, "hidden_skip_n": cfg.hidden_skip_n,
            "data": {"digest": prep.digest, "files": len(pl.files), "samples": pl.rows,
                     "train_files": len(prep.train), "val_files": len(prep.val), "streams": pl.streams,
                     "gaps": pl.gaps, "truncated_returns": pl.truncated,
                     "obs_layout": {"binary_columns": len(prep.layout.binary), "other_columns": len(prep.layout.rest),
                                    "other_dtype": prep.layout.rest_dtype,
                                    "bytes_per_sample": prep.layout.bytes_per_sample}}}


def _num_actions(env: str) -> int:
    from rl.envs import BatchedEnv

    return BatchedEnv(env, 1).num_actions


def _boundary(u: int, cfg: OfflineConfig, every: tuple[int, ...]) -> int:
    """The next update number > u at which a chunk must end."""
    return min([cfg.steps] + [(u // k + 1) * k for k in every if k])


def train(cfg: OfflineConfig, *, resume: bool = False, stop_after: int | None = None, quiet: bool = False,
          tracking: Any = None, say: Callable[[str], None] = _stderr,
          should_stop: Callable[[], bool] | None = None) -> Path:
    """Run (or, with `resume`, continue) offline AWR training; returns the run directory.

    `stop_after`: stop once this update is done and checkpointed (it must be a checkpoint boundary; tests use
    it to stand for a kill). `should_stop`, asked after every dispatch (rl.interrupt's Ctrl-C): stop there with
    a metrics record and a checkpoint; at most two dispatches are in flight, so a stop comes within one dispatch.
    Raises ValueError / TrajectoryError (one line) for bad settings and files.

    A new run stores its data directory as an absolute path, so `--resume` works from any working directory; a
    resume may point `data` at a moved copy of the dataset (the same file names, sizes and sample counts)."""
    import dataclasses

    cfg.validate()
    run_dir = Path(cfg.out)
    if not Path(cfg.data).is_dir():
        raise ValueError(f"--data {cfg.data}: not a directory" + (
            f" (the run's dataset, as config.json records it; if it moved, point the run at it with --resume "
            f"{run_dir} --data DIR)" if resume else ""))
    cfg = dataclasses.replace(cfg, data=str(Path(cfg.data).resolve()))
    if resume:
        stored = read_run_config(run_dir)
        old = config_of(stored)
        diff = resume_differences(old.to_json(), cfg.to_json(), RESUME_MUTABLE + ("data",))
        if diff:
            raise ValueError(f"--resume {run_dir}: these settings differ from the run's config.json: " + ", ".join(
                f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()) + "; start a new run to change them")
    elif (run_dir / "config.json").exists() or (run_dir / "checkpoints").exists():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, or pick another --out")
    prep = prepare(cfg, say)
    num_actions = _num_actions(prep.env)
    if resume and stored["data"]["digest"] != prep.digest:
        raise ValueError(f"--resume {run_dir}: the files in {cfg.data} differ from those the run trained on "
                         f"(names, sizes or sample counts changed); resume with the same data")
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / "config.json", run_config(cfg, prep, num_actions))

    net = AWRNetwork(num_actions, cfg.width)
    optimizer = optax.adam(cfg.lr)
    state = init_state(net, optimizer, prep.layout.obs_size, prep.hidden_size if cfg.uses_hidden else None, cfg.seed)
    if cfg.uses_hidden:
        state["stats"] = {k: jnp.asarray(v) for k, v in prep.stats.items()}
    ckpt = Checkpoints(run_dir, keep=cfg.keep_checkpoints)
    log = MetricsLog(run_dir / "metrics.jsonl")
    start = 0
    if resume and ckpt.latest_step() is not None:
        start, state = ckpt.restore_newest(state)
        say(f"resuming {run_dir} at update {start:,} (its checkpoint's normalisation statistics)")
    log.truncate_after(start)
    stats = state.get("stats")

    train_rows = int(sum(prep.plan.files[i].samples for i in prep.train))
    resident = cfg.resident == "on" or (cfg.resident == "auto" and train_rows * _row_bytes(prep, cfg)
                                        <= 0.7 * device_limit_bytes())
    if resident:
        shards = ResidentShards(prep, cfg.uses_hidden)
    else:
        shards = StreamedShards(prep, cfg.uses_hidden, cfg.shard_samples, cfg.batch_size, cfg.seed)
    val_shard = _val_shard(prep, cfg)
    apply = net.apply
    chunk = make_train_chunk(apply, optimizer, prep.layout, mode=cfg.hidden, batch_size=cfg.batch_size,
                             beta=cfg.beta, weight_clip=cfg.weight_clip, value_coef=cfg.value_coef, seed=cfg.seed)
    validate = make_validation(apply, prep.layout, mode=cfg.hidden, seed=cfg.seed, batch=VAL_BATCH)
    trackers = None
    if tracking is not None and tracking.any:
        from rl.tracking import Trackers

        trackers = Trackers(tracking, run_dir, cfg.to_json())
    if not quiet:
        pl = prep.plan
        say(f"{prep.env}: {pl.rows:,} samples in {len(pl.files)} files ({len(prep.train)} train, {len(prep.val)} "
            f"held out), hidden {cfg.hidden}" + (f" (held {cfg.hidden_skip_n} steps)" if cfg.uses_hidden else "")
            + f"; {'resident on the device' if resident else f'{shards.count} streamed shards'}, "
              f"{shards.bytes_per_row} B/sample; run directory {run_dir}")
        say(f"compiling the update ({cfg.updates_per_dispatch} updates per dispatch) ...")

    params, opt_state = state["params"], state["opt_state"]
    u, t0, t_log, u_log = start, time.perf_counter(), time.perf_counter(), start
    pending: list[tuple[int, dict]] = []
    stop_at = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    flight = {"done": start, "to": start}  # updates finished on the device / dispatched (for a Ctrl-C's message)
    waiting: tuple[int, Any] | None = None  # the previous dispatch: (its last update, its metrics)
    if hasattr(should_stop, "describe"):  # rl.interrupt.StopOnInterrupt: say what a Ctrl-C now does, in numbers
        should_stop.describe = lambda: (  # type: ignore[union-attr]
            f"Ctrl-C: stopping after update {flight['to']:,}, {flight['to'] - flight['done']:,} updates from now (those "
            f"dispatched or due), with a checkpoint; {cfg.steps - flight['to']:,} of {cfg.steps:,} updates will remain "
            f"for python -m rl.offline train --resume {run_dir}")
    next_end = lambda u: min(_boundary(u, cfg, (cfg.log_every, cfg.checkpoint_every, shards.updates_per_shard)),
                             u + cfg.updates_per_dispatch, stop_at)
    try:
        while u < stop_at:
            end = next_end(u)
            shard, rows = shards.for_update(u)
            flight["to"] = end
            params, opt_state, m = chunk(params, opt_state, shard, rows, stats, jnp.int32(u), length=end - u)
            pending.append((end - u, m))
            u = end
            if waiting is not None:  # at most two dispatches in flight: a stop comes within one dispatch
                jax.block_until_ready(waiting[1])
                flight["done"] = waiting[0]
            waiting = (u, m)
            if should_stop is not None and should_stop():
                stop_at = u
            elif u < stop_at:
                flight["to"] = next_end(u)  # from here on (the record, the checkpoint) the next dispatch is due
            if u % cfg.log_every == 0 or u == cfg.steps or u == stop_at:
                rec = _record(u, cfg, pending, validate(params, val_shard, stats) if val_shard else None,
                              u - u_log, t_log)
                pending, t_log, u_log = [], time.perf_counter(), u
                log.append(rec)
                if trackers is not None:
                    trackers.record(rec)
                if not quiet:
                    say(_status(rec, cfg, time.perf_counter() - t0, start))
            if u % cfg.checkpoint_every == 0 or u == cfg.steps or u == stop_at:
                ckpt.save(u, {**state, "params": params, "opt_state": opt_state, "update": jnp.int32(u)})
    finally:
        shards.close()
        ckpt.close()
        if trackers is not None:
            trackers.finish()
    if not quiet:
        say(f"{'finished' if u >= cfg.steps else 'stopped at'} update {u:,}/{cfg.steps:,} in "
            f"{_duration(time.perf_counter() - t0)}" + ("" if u >= cfg.steps else f" ({cfg.steps - u:,} updates "
                                                         f"remain)") + f"; run directory {run_dir}\n  evaluate: "
            f"python -m rl.offline eval {run_dir}" + ("" if u >= cfg.steps else f"\n  continue: python -m rl.offline "
                                                                                 f"train --resume {run_dir}"))
    return run_dir


def _row_bytes(prep: Prepared, cfg: OfflineConfig) -> int:
    return prep.layout.bytes_per_sample + (2 * prep.hidden_size if cfg.uses_hidden else 0) + 8


def _val_shard(prep: Prepared, cfg: OfflineConfig) -> dict | None:
    """The held-out files' first `val_samples` rows on the device, padded to whole batches (`valid` mask)."""
    if not prep.val:
        return None
    host = D.build_shard(prep.plan, prep.layout, prep.val, cfg.uses_hidden)
    n = min(len(host["rtg"]), cfg.val_samples)
    host = {k: v[:n] for k, v in host.items()}
    cap = -(-n // VAL_BATCH) * VAL_BATCH
    host = pad_rows(host, cap)
    host["valid"] = np.arange(cap) < n
    return jax.device_put(host)


def _record(u: int, cfg: OfflineConfig, pending, val, done: int, since: float) -> dict[str, Any]:
    """The metrics record at update `u`: the loss terms averaged over the updates since the last record (read
    from the device here: this waits for them), the validation losses, and updates/s over `done` updates."""
    total = sum(n for n, _ in pending)
    got, val = jax.device_get(([m for _, m in pending], val))
    rec: dict[str, Any] = {"update": u, "timestep": u * cfg.batch_size,
                           "updates_per_s": done / max(time.perf_counter() - since, 1e-9)}
    for k in got[0]:
        rec[k] = float(sum(n * g[k] for (n, _), g in zip(pending, got)) / total)
    if val is not None:
        rec.update({f"val_{k}": float(v) for k, v in val.items()})
    return rec


def _status(rec: dict, cfg: OfflineConfig, elapsed: float, start: int) -> str:
    u = rec["update"]
    parts = [f"[update {u:,}/{cfg.steps:,}] loss {rec['loss']:.4f} (actor {rec['actor_loss']:.4f}, value "
             f"{rec['value_loss']:.4f})"]
    if "val_nll" in rec:
        parts.append(f"val nll {rec['val_nll']:.4f} value {rec['val_value_loss']:.4f}")
    parts.append(f"{rec['updates_per_s']:,.0f} updates/s")
    parts.append(f"elapsed {_duration(elapsed)}")
    if u < cfg.steps and u > start:
        parts.append(f"ETA {_duration(elapsed / (u - start) * (cfg.steps - u))}")
    return " | ".join(parts)


def resume_config(run_dir: Path, overrides: dict[str, Any]) -> OfflineConfig:
    """The stored settings of `run_dir` with the given (RESUME_MUTABLE) overrides and `out` = run_dir."""
    import dataclasses

    cfg = config_of(read_run_config(run_dir))
    bad = sorted(k for k in overrides if k not in RESUME_MUTABLE + ("data",))
    if bad:
        raise ValueError(f"--resume takes the run's own settings; {', '.join('--' + k.replace('_', '-') for k in bad)}"
                         f" cannot change (it may change: "
                         f"{', '.join('--' + k.replace('_', '-') for k in RESUME_MUTABLE if k != 'out')}, and --data "
                         f"to point it at its dataset moved elsewhere)")
    return dataclasses.replace(cfg, **overrides, out=str(run_dir))


__all__ = ["train", "prepare", "resume_config", "TrajectoryError"]

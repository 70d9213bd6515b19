"""`python -m rl.train`: PPO on Craftax, optionally with an LLM hidden state (--encoder none|inscan|vllm).

Examples:
    python -m rl.train --encoder=inscan --preset cpu            # a few minutes on a laptop CPU
    python -m rl.train --encoder none --env Craftax-Classic-Symbolic-v1 --total-timesteps 30000000
    python -m rl.train --resume checkpoints/<run>               # continue a stopped run
    python -m rl.train --devices 4 --num-envs 512               # env batch split over 4 GPUs (docs/MULTIGPU.md)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from render.envs import ENV_NAMES
from rl.config import (ENCODERS, LLM_DTYPES, LLM_ENCODES, OBS_FORMATS, POOLINGS, PRESETS, RESUME_OVERRIDABLE, TEMPLATE_ASSEMBLIES,
                       TrainConfig, load_config, resolve_devices)
from rl.encoders import LLMArgs
from rl.networks import FUSIONS
from rl.ppo import SHUFFLES
from rl.rundir import Checkpoints, MetricsLog, RunDirError, open_run_dir
from rl.sharding import (agree_with_main_process, check_same_on_all_processes, is_main_process,
                         maybe_initialize_distributed)

CHOICES = {"env": ENV_NAMES, "encoder": ENCODERS, "obs_format": OBS_FORMATS, "template_assembly": TEMPLATE_ASSEMBLIES,
           "pooling": POOLINGS,
           "llm_dtype": LLM_DTYPES, "llm_encode": LLM_ENCODES, "fusion": FUSIONS,
           "shuffle": SHUFFLES}


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the last good state is in the run directory's checkpoints."""


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--preset", choices=sorted(PRESETS), help="named set of defaults (flags override it)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its config.json decides everything)")
    p.add_argument("--max-updates", "--max_updates", type=int, dest="max_updates",
                   help="stop (with a checkpoint) after this many updates in this invocation")
    p.add_argument("--time-limit", "--time_limit", type=float, dest="time_limit",
                   help="stop (with a checkpoint) once this many seconds have passed")
    p.add_argument("--quiet", action="store_true", help="no status line")
    for f in dataclasses.fields(TrainConfig):
        flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        kw: dict[str, Any] = {"dest": f.name}
        if f.name in CHOICES:
            kw["choices"] = CHOICES[f.name]
        elif isinstance(f.default, bool):
            kw["type"] = _bool
        elif isinstance(f.default, (int, float)):
            kw["type"] = type(f.default)
        else:
            kw["type"] = str
        p.add_argument(*flags, **kw)
    return p


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults <- preset <- explicit flags."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = dict(PRESETS[args.preset]) if "preset" in args else {}
    values.update({k: v for k, v in vars(args).items() if k in fields})
    return TrainConfig(**values)


def default_run_dir(cfg: TrainConfig) -> Path:
    short = cfg.env.replace("Craftax-", "").replace("-Symbolic-v1", "").lower() or "craftax"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("checkpoints") / f"{short}-{cfg.encoder}-s{cfg.seed}-{stamp}"


def _status(cfg: TrainConfig, rec: dict, quiet: bool) -> None:
    if quiet:
        return
    ret = rec.get("episode_return")
    ret_s = "   -  " if ret is None or not math.isfinite(ret) else f"{ret:6.2f}"
    line = (f"[update {rec['update']}/{cfg.num_updates}] step {rec['timestep']:,} | {rec['sps']:,.0f} SPS | "
            f"return {ret_s} | loss {rec['total_loss']:.4f} | entropy {rec['entropy']:.3f}")
    if sys.stderr.isatty():
        print("\r" + line, end="", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def _record(cfg: TrainConfig, names: Sequence[str], update: int, m: dict, seconds: float,
            llm_share: float) -> dict:
    rec = {"update": update, "timestep": update * cfg.batch_size, "sps": cfg.batch_size / seconds,
           "seconds": seconds, "llm_time_share": llm_share}
    for k, v in m.items():
        if k == "achievements":
            rec["achievements"] = {n: float(x) for n, x in zip(names, np.asarray(v))}
        else:
            rec[k] = float(v)
    return rec


@dataclass(frozen=True)
class OpenRun:
    """A run directory opened for training (`open_run`): its config, checkpoints, metrics log and progress."""

    cfg: TrainConfig  # as written to config.json: run_dir set, --devices resolved
    run_dir: Path
    ckpt: Checkpoints
    log: MetricsLog
    start: int  # updates already done (the newest checkpoint's)
    recorder: Any = None  # rl.trajectories.TrajectoryWriter of --save-trajectories (continues at `start`)

    def close(self) -> None:
        """Close the checkpoints and write the recorder's last samples."""
        try:
            if self.recorder is not None:
                self.recorder.close()
        finally:
            self.ckpt.close()


def open_run(cfg: TrainConfig, run_dir: Path | None = None, *, resume: bool = False) -> OpenRun:
    """Validate `cfg`, resolve its device count and open (create, or check and continue) its run directory.

    Everything that can refuse the run does so here, before an LLM is loaded. With several processes every
    process calls this; only process 0 writes config.json.
    """
    if run_dir is None and not cfg.run_dir and jax.process_count() > 1:
        raise ValueError(f"with {jax.process_count()} processes pass --run-dir (one directory that every process "
                         f"can reach, e.g. on a shared file system)")
    run_dir = Path(run_dir or cfg.run_dir or default_run_dir(cfg))
    cfg = resolve_devices(dataclasses.replace(cfg, run_dir=str(run_dir)), resumed=resume)
    shared = {k: v for k, v in cfg.to_json().items() if k != "vllm_url"}  # each host may use its own server
    check_same_on_all_processes(json.dumps(shared, sort_keys=True), "config (flags or config.json)")
    if cfg.encoder == "inscan" and cfg.template_assembly == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"--template-assembly pallas needs a GPU (on {jax.default_backend()} Pallas's interpreter "
                         f"would run it, which fails inside the trainer's shard_map); use auto or jnp")
    if cfg.save_trajectories is not None:
        if jax.process_count() > 1:
            raise ValueError("--save-trajectories records from one process; several processes are not supported yet")
        if not resume:
            from rl.trajectories import check_new_stream

            check_new_stream(Path(cfg.save_trajectories))
    if cfg.encoder == "vllm":  # fail fast, before touching the run directory
        from rl.encoders import check_vllm_reachable

        check_vllm_reachable(cfg.vllm_url, cfg.vllm_timeout)
    _open_run_dir_on_main_process(cfg, run_dir, resume)
    ckpt = Checkpoints(run_dir, keep=cfg.keep_checkpoints)
    log = MetricsLog(run_dir / "metrics.jsonl", writable=is_main_process())
    start = ckpt.latest_step() or 0
    if start >= cfg.num_updates:  # finished: its checkpoint must restore (a damaged one falls back to an older one)
        start, _ = ckpt.restore_newest(None)
    if not resume and start == 0 and log.read():
        log.truncate_after(0)
    recorder = None
    if cfg.save_trajectories is not None:
        from rl.trajectories import TrajectoryWriter

        meta = {"env": cfg.env, "num_envs": cfg.num_envs, "num_steps": cfg.num_steps, "encoder": cfg.encoder,
                "run_dir": str(run_dir), "source": "rl.train"}
        recorder = TrajectoryWriter(Path(cfg.save_trajectories), cfg.samples_per_file, meta,
                                    first_sample=start * cfg.batch_size, continue_stream=resume)
    return OpenRun(cfg, run_dir, ckpt, log, start, recorder)


def train(cfg: TrainConfig, run_dir: Path | None = None, *, resume: bool = False, max_updates: int | None = None,
          time_limit: float | None = None, quiet: bool = False) -> Path:
    """Run (or continue) a training run; returns its run directory. Raises TrainingDiverged on NaN.

    With several processes (`rl.sharding.maybe_initialize_distributed`) every process calls this with the
    same arguments; only process 0 writes config.json and metrics.jsonl and prints, all write checkpoints.
    """
    run = open_run(cfg, run_dir, resume=resume)
    try:
        if run.start < run.cfg.num_updates:
            run_updates(run, max_updates=max_updates, time_limit=time_limit, quiet=quiet or not is_main_process())
        elif is_main_process():
            print(f"{run.run_dir}: run already finished ({run.start}/{run.cfg.num_updates} updates); nothing to do",
                  flush=True)
    finally:
        run.close()
    return run.run_dir


def run_updates(run: OpenRun, *, max_updates: int | None = None, time_limit: float | None = None,
                quiet: bool = False) -> None:
    """The training loop of an opened run: load the encoder, restore the newest checkpoint, then update, log and
    checkpoint until the run ends, `max_updates` updates were done here or `time_limit` seconds passed."""
    from rl.encoders import load_encoder
    from rl.trainer import Trainer

    cfg, run_dir, ckpt, log, start = run.cfg, run.run_dir, run.ckpt, run.log, run.start
    main_process = is_main_process()
    llm, vllm = load_encoder(cfg)
    trainer = Trainer(cfg, llm, vllm)
    llm_args = trainer.place_llm_args(llm.jit_args if llm is not None else LLMArgs())
    runner = trainer.init_state(llm_args)
    if start:  # newest first; one that does not restore is reported and set aside
        start, runner = ckpt.restore_newest(runner)
        if main_process:
            print(f"resuming {run_dir} at update {start}/{cfg.num_updates}", flush=True)
    log.truncate_after(start)

    t_start = time.perf_counter()
    done_here, llm_share = 0, None
    saved_at = start if start else None  # update count of the newest checkpoint
    for update in range(start, cfg.num_updates):
        t0 = time.perf_counter()
        llm_t0 = vllm.seconds if vllm else 0.0
        new_runner, m = trainer.step(runner, llm_args, run.recorder.add_rollout if run.recorder else None)
        seconds = time.perf_counter() - t0
        if not math.isfinite(float(m["total_loss"])):
            if saved_at != update:
                ckpt.save(update, runner)
            raise TrainingDiverged(
                f"loss is {float(m['total_loss'])} at update {update + 1}; stopped. The last good state "
                f"(update {update}) is checkpointed in {run_dir}/checkpoints; lower --lr or check the inputs")
        runner = new_runner
        if vllm is not None:
            llm_share = (vllm.seconds - llm_t0) / seconds
        elif llm is None:
            llm_share = 0.0
        elif done_here == 1:  # in-scan: estimated once, on an already compiled update
            llm_share = trainer.time_llm_share(runner, llm_args, seconds)
        rec = _record(cfg, trainer.env.achievement_names, update + 1, m, seconds, llm_share)
        if done_here == 0:
            rec["first_call_includes_compile"] = True
        log.append(rec)
        _status(cfg, rec, quiet)
        done_here += 1
        finished = update + 1 == cfg.num_updates
        stop = max_updates is not None and done_here >= max_updates
        if time_limit is not None:  # clocks differ between processes: process 0 decides for all
            stop = agree_with_main_process(stop or time.perf_counter() - t_start >= time_limit)
        if finished or stop or (update + 1) % cfg.checkpoint_every == 0:
            ckpt.save(update + 1, runner)
            saved_at = update + 1
        if stop and not finished:
            if main_process:
                print(f"\nstopped at update {update + 1}/{cfg.num_updates}; continue with --resume {run_dir}",
                      file=sys.stderr, flush=True)
            return
    if not quiet:
        print(f"\nfinished {cfg.num_updates} updates; run directory {run_dir}", file=sys.stderr, flush=True)


def _open_run_dir_on_main_process(cfg: TrainConfig, run_dir: Path, resume: bool) -> None:
    """`open_run_dir` in process 0 only; every process raises if it refused (a collective)."""
    error = None
    if is_main_process():
        try:
            open_run_dir(cfg, run_dir, resume=resume)
        except RunDirError as e:
            error = e
    if not agree_with_main_process(error is None):
        raise error or RunDirError(f"process 0 refused the run directory {run_dir} (its log says why)")


def main(argv: Sequence[str] | None = None) -> int:
    from jaxllm.http.client import VLLMError

    parser = build_parser()
    args = parser.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        maybe_initialize_distributed()  # multi-host launch when JAX_COORDINATOR_ADDRESS etc. are set
        if "resume" in args:
            extra = sorted(k for k in vars(args) if k in fields | {"preset"} and k not in RESUME_OVERRIDABLE)
            if extra:
                parser.error(f"--resume takes its settings from the run's config.json; drop "
                             f"{', '.join('--' + e.replace('_', '-') for e in extra)}")
            run_dir = Path(args.resume)
            cfg = load_config(run_dir / "config.json")
            cfg = dataclasses.replace(cfg, **{k: getattr(args, k) for k in RESUME_OVERRIDABLE if k in args})
            train(cfg, run_dir, resume=True, max_updates=getattr(args, "max_updates", None),
                  time_limit=getattr(args, "time_limit", None), quiet="quiet" in args)
        else:
            cfg = resolve_config(args)
            try:
                cfg.validate()
            except ValueError as e:
                parser.error(str(e))
            train(cfg, getattr(args, "run_dir", None), max_updates=getattr(args, "max_updates", None),
                  time_limit=getattr(args, "time_limit", None), quiet="quiet" in args)
    except (RunDirError, TrainingDiverged, ConnectionError, FileNotFoundError, ValueError, VLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

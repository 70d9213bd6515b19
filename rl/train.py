"""`python -m rl.train`: PPO on Craftax, optionally with an LLM hidden state (--encoder none|inscan|vllm).

Examples:
    python -m rl.train --encoder=inscan --preset cpu            # a few minutes on a laptop CPU
    python -m rl.train --encoder none --env Craftax-Classic-Symbolic-v1 --total-timesteps 30000000
    python -m rl.train --resume checkpoints/<run>               # continue a stopped run
    python -m rl.train --devices 4 --num-envs 512               # env batch split over 4 GPUs (docs/MULTIGPU.md)
    python -m rl.train --preset cpu --track --tensorboard       # Weights & Biases + TensorBoard (extra [track])
    python -m rl.train --config checkpoints/<run>/config.json --seed 1   # another run with the same settings
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from rl.cli import Parser, add_compile_cache_option, add_dataclass_options, apply_compile_cache, prompt_text
from rl.config import (CHOICES, GROUPS, PRESETS, RESUME_OVERRIDABLE, SECTION_OF, TrainConfig, flat_fields,
                       inapplicable_flags, load_config, read_settings_file, resolve_devices)
from rl.encoder_kinds import kind_of, load_encoder
from rl.interrupt import StopOnInterrupt
from rl.loop import RunOutputs, StopRule, TrainingDiverged, run_loop
from rl.progress import Progress, compile_hint
from rl.rundir import Checkpoints, MetricsLog, RunDirError, open_run_files
from rl.tracking import TrackingOptions, Trackers, TrackingUnavailable
from rl.sharding import (check_same_on_all_processes, is_main_process,
                         maybe_initialize_distributed)

class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C after the run had started: the message says which checkpoint is kept and how to continue."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m rl.train", description=__doc__, argument_default=argparse.SUPPRESS)
    run = p.add_argument_group("this invocation")
    run.add_argument("--preset", choices=sorted(PRESETS),
                     help="named set of defaults for a machine size: cpu = minutes on a laptop, test = seconds "
                          "(flags override it)")
    run.add_argument("--config", metavar="FILE",
                     help="settings from a JSON or YAML file, e.g. a run directory's config.json (its run_dir is "
                          "ignored); --preset and flags override it")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its config.json decides everything)")
    run.add_argument("--max-updates", type=int, dest="max_updates", metavar="N",
                     help="stop (with a checkpoint) after this many updates in this invocation")
    run.add_argument("--time-limit", type=float, dest="time_limit", metavar="SECONDS",
                     help="stop (with a checkpoint) once this many seconds have passed")
    run.add_argument("--quiet", action="store_true", help="no status line, only one line per checkpoint")
    add_compile_cache_option(run)
    track = p.add_argument_group("tracking (pip install -e \".[track]\")")
    track.add_argument("--track", action="store_true",
                       help="log the config, every metrics record and the curves to Weights & Biases (WANDB_MODE="
                            "offline works without network); --resume continues the same wandb run")
    track.add_argument("--tensorboard", action="store_true",
                       help="write TensorBoard event files of every metrics record to RUN_DIR/tensorboard")
    track.add_argument("--wandb-project", metavar="NAME", default=argparse.SUPPRESS,
                       help=f"Weights & Biases project (default: {TrackingOptions.project})")
    track.add_argument("--wandb-entity", metavar="NAME", help="Weights & Biases team or user (default: yours)")
    track.add_argument("--wandb-group", metavar="NAME", help="Weights & Biases run group (default: none)")
    track.add_argument("--run-name", metavar="NAME", help="the run's name in Weights & Biases (default: the run "
                                                          "directory's name)")
    add_dataclass_options(p, flat_fields(), GROUPS, CHOICES, types={"system_prompt": prompt_text})
    return p


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults <- --config file <- preset <- explicit flags."""
    fields = set(SECTION_OF)
    values = read_settings_file(args.config) if "config" in args else {}
    values.update(PRESETS[args.preset] if "preset" in args else {})
    values.update({k: v for k, v in vars(args).items() if k in fields})
    return TrainConfig(**values)


def default_run_dir(cfg: TrainConfig) -> Path:
    short = cfg.env.replace("Craftax-", "").replace("-Symbolic-v1", "").lower() or "craftax"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("checkpoints") / f"{short}-{cfg.encoder}-s{cfg.seed}-{stamp}"


@dataclass(frozen=True)
class OpenRun:
    """A run directory opened for training (`open_run`): its config, checkpoints, metrics log and recorder."""

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
    cfg = resolve_devices(cfg.replace(run_dir=str(run_dir)), resumed=resume)
    shared = {k: v for k, v in cfg.to_json().items() if k != "vllm_url"}  # each host may use its own server
    check_same_on_all_processes(json.dumps(shared, sort_keys=True), "config (flags or config.json)")
    if cfg.save_trajectories is not None:
        if jax.process_count() > 1:
            raise ValueError("--save-trajectories records from one process; several processes are not supported yet")
        if not resume:
            from rl.trajectories import check_new_stream

            check_new_stream(Path(cfg.save_trajectories))
    kind_of(cfg.hidden).preflight(cfg.hidden, cfg.llm)  # e.g. no server: fail fast, before the run directory
    ckpt, log = open_run_files(cfg, run_dir, resume=resume)
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


def _compile_ahead(progress: Progress):
    """An `rl.jit.CompileAhead` that says on `progress` what it waits for."""
    from rl.jit import CompileAhead

    return CompileAhead(progress.step)


def start_update_compile(trainer, llm_args, progress: Progress, backend: str,
                         traced: threading.Event | None = None):
    """Compile the trainer's update in a background thread (`rl.jit.CompileAhead`) while the run sets up (the LLM's
    weights loading, the env reset, the first states' LLM call): the compiles overlap instead of following each
    other. `llm_args` may be shapes (`Trainer.llm_arg_shapes`): the weights need not be loaded yet. `traced`: set
    once the update is traced and lowered (or failed), before XLA compiles it (`start_first_encode_compile` waits
    for it and reuses its trace of the LLM). The update starts first because it is the longest compile: it decides
    when the first update can run. None where the update is not one jitted program (the HTTP kind's host loop)."""
    if not trainer.runs_update:
        if traced is not None:
            traced.set()
        return None
    ahead = _compile_ahead(progress)
    progress.step(f"compiling the update in the background ({compile_hint(backend)}) ...")
    lowered = traced.set if traced is not None else (lambda: None)  # also set if the compile fails (Trainer's)
    ahead.submit("update", lambda: trainer.compile_update(llm_args, on_lowered=lowered))
    return ahead


def start_first_encode_compile(trainer, encoder, ahead, progress: Progress, backend: str,
                               traced: threading.Event) -> None:
    """Compile the env reset at once, and the first states' LLM call (`Trainer.compile_start`) once `traced` is set
    (the update's trace, whose LLM trace it reuses: Python tracing holds the interpreter, so two traces at once take
    as long as one after the other), each in a background thread of `ahead`, from the LLM's shapes, while its
    weights load (`Encoder.load_weights`)."""
    llm_args = trainer.llm_arg_shapes(encoder.jit_args())
    progress.step(f"compiling the env reset and then the first states' LLM call in the background "
                  f"({compile_hint(backend, 'llm')}) ...")
    ahead.submit("env reset", trainer.compile_reset)

    def compile_first_encode():
        traced.wait()
        return trainer.compile_start(llm_args)

    ahead.submit("first encode", compile_first_encode)


def train(cfg: TrainConfig, run_dir: Path | None = None, *, resume: bool = False, max_updates: int | None = None,
          time_limit: float | None = None, quiet: bool = False, tracking: TrackingOptions | None = None,
          should_stop: Callable[[], bool] | None = None) -> Path:
    """Run (or continue) a training run; returns its run directory. Raises TrainingDiverged on NaN.

    `tracking`: Weights & Biases / TensorBoard (rl.tracking); `should_stop`, asked after every update: stop there
    with a checkpoint (rl.interrupt's Ctrl-C). A run directory this call created is removed again when the start
    fails (bad model, Ctrl-C while loading or compiling) before the first update was logged.

    With several processes (`rl.sharding.maybe_initialize_distributed`) every process calls this with the
    same arguments; only process 0 writes config.json and metrics.jsonl and prints, all write checkpoints.

    This is the one place that reads the whole config: the run directory gets it to write config.json, and every
    other part gets its section (`envs`, `ppo`, `hidden`, `llm`) or the few values it uses.
    """
    from rl.trainer import Trainer

    if tracking is not None:
        tracking.check_installed()
    target = Path(run_dir or cfg.run_dir or default_run_dir(cfg))
    created = not target.exists()
    run = open_run(cfg, target, resume=resume)
    cfg, main_process = run.cfg, is_main_process()
    trackers = Trackers(tracking, run.run_dir, cfg.to_json()) if (
        tracking is not None and tracking.any and main_process) else None
    progress = Progress(run.run_dir, cfg.num_updates, cfg.batch_size, shows_llm=cfg.uses_llm,
                        quiet=quiet or not main_process, enabled=main_process)
    failed_start = False
    try:
        if run.start < cfg.num_updates:
            progress.starting(f"{cfg.env}, {cfg.num_envs:,} envs x {cfg.num_steps} steps per update, "
                              f"{cfg.num_updates:,} updates ({cfg.total_timesteps:,} env steps)",
                              cfg.devices, jax.default_backend())
            backend = jax.default_backend()
            later = cfg.uses_llm and kind_of(cfg.hidden).loads_weights_later
            if later:
                progress.step(f"reading the LLM's config and tokenizer ({cfg.model}) ...")
            elif cfg.uses_llm:
                progress.step(f"loading the LLM ({cfg.model}) and its tokenizer (reading the weights, then the "
                              f"prompt head's cache) ...")
            # the in-scan LLM's weights stay shapes for now: its programs compile from shapes while they load
            encoder = load_encoder(cfg.hidden, cfg.llm, cfg.env, weights=not later)
            trainer = Trainer(cfg.envs, cfg.ppo, encoder, devices=cfg.devices, fusion=cfg.fusion,
                              records=run.recorder is not None, speed=cfg.speed)
            traced = threading.Event()  # the update is traced (its LLM trace is then reused by the first encode)
            ahead = start_update_compile(trainer, trainer.llm_arg_shapes(encoder.jit_args()), progress, backend,
                                         traced)
            if encoder.weights_pending:
                ahead = ahead or _compile_ahead(progress)
                start_first_encode_compile(trainer, encoder, ahead, progress, backend, traced)
                progress.step(f"loading the LLM's weights ({cfg.model}: reading or drawing them, then the prompt "
                              f"head's cache) while those compile ...")
                encoder.load_weights()
            if cfg.uses_llm:
                progress.step(encoder.describe())
            llm_args = trainer.place_llm_args(encoder.jit_args())
            if ahead is not None and ahead.started("first encode"):
                ahead.get("env reset")
                ahead.get("first encode")
                progress.step(f"resetting the envs and encoding their first states (the LLM call compiled ahead, "
                              f"{ahead.seconds('first encode'):.0f} s in the background) ...")
            elif cfg.uses_llm:
                progress.step(f"resetting the envs and encoding their first states (compiles the LLM call: "
                              f"{compile_hint(backend, 'llm')}) ...")
            state = trainer.init_state(llm_args)
            if ahead is not None:
                ahead.get("update")
                progress.compiled_ahead(ahead.seconds("update"))
            updates = trainer.updates(llm_args, run.recorder.add_rollout if run.recorder else None)
            outputs = RunOutputs(run.run_dir, run.ckpt, run.log, progress, trackers, batch_size=cfg.batch_size,
                                 achievement_names=trainer.env.achievement_names,
                                 checkpoint_every=cfg.checkpoint_every)
            state, start = outputs.start_from(state, run.start)
            last = cfg.num_updates if max_updates is None else min(cfg.num_updates, start + max_updates)
            run_loop(updates, state, start, cfg.num_updates, outputs, StopRule(last, time_limit, should_stop))
        elif main_process:
            print(f"{run.run_dir}: run already finished ({run.start}/{cfg.num_updates} updates); nothing to do",
                  flush=True)
    except KeyboardInterrupt:
        failed_start = created and main_process and not run.log.read()
        if failed_start:
            raise
        saved = run.ckpt.latest_step() or 0
        raise RunInterrupted(f"interrupted (Ctrl-C); the checkpoint of update {saved} is kept: continue with "
                             f"python -m rl.train --resume {run.run_dir}") from None
    except BaseException:
        failed_start = created and main_process and not run.log.read()
        raise
    finally:
        if trackers is not None:
            trackers.close()
        run.close()
        if failed_start:
            shutil.rmtree(run.run_dir, ignore_errors=True)
    return run.run_dir


def _note_gpu_sized_defaults_on_cpu(args: argparse.Namespace) -> None:
    """One line when a run keeps the reference's GPU-sized batch and length on a CPU backend."""
    sized = {"preset", "config", "env", "num_envs", "num_steps", "total_timesteps"}
    if not sized & set(vars(args)) and jax.default_backend() == "cpu":
        print("note: the defaults are the reference's GPU run (1,024 envs, 10M steps: days on a CPU); "
              "add --preset cpu for a run of minutes", file=sys.stderr, flush=True)


def tracking_options(args: argparse.Namespace) -> TrackingOptions | None:
    """--track / --tensorboard and their --wandb-* / --run-name settings (None when neither is on)."""
    opts = TrackingOptions(wandb="track" in args, tensorboard="tensorboard" in args,
                           project=getattr(args, "wandb_project", TrackingOptions.project),
                           entity=getattr(args, "wandb_entity", None), group=getattr(args, "wandb_group", None),
                           run_name=getattr(args, "run_name", None))
    return opts if opts.any else None


def main(argv: Sequence[str] | None = None) -> int:
    """rl.train's command line; returns the exit code (130 when stopped by Ctrl-C)."""

    parser = build_parser()
    args = parser.parse_args(argv)
    fields = set(SECTION_OF)
    wandb_flags = [f for f in ("wandb_project", "wandb_entity", "wandb_group", "run_name") if f in args]
    if wandb_flags and "track" not in args:
        parser.error(f"{', '.join('--' + f.replace('_', '-') for f in wandb_flags)} "
                     f"{'has' if len(wandb_flags) == 1 else 'have'} no effect without --track; add --track")
    tracking = tracking_options(args)
    apply_compile_cache(args)
    stop = StopOnInterrupt(lambda text: print("\n" + text, file=sys.stderr, flush=True))
    try:
        with stop:
            return _main(parser, args, fields, tracking, stop)
    except RunInterrupted as e:
        print(f"\n{e}", file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C) before the first update; nothing was saved", file=sys.stderr, flush=True)
        return 130
    except TrackingUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, fields: set[str],
          tracking: TrackingOptions | None, stop: StopOnInterrupt) -> int:
    from jaxllm.http.client import VLLMError

    run = dict(max_updates=getattr(args, "max_updates", None), time_limit=getattr(args, "time_limit", None),
               quiet="quiet" in args, tracking=tracking, should_stop=stop)
    try:
        maybe_initialize_distributed()  # multi-host launch when JAX_COORDINATOR_ADDRESS etc. are set
        if "resume" in args:
            extra = sorted(k for k in vars(args) if k in fields | {"preset"} and k not in RESUME_OVERRIDABLE)
            if extra:
                parser.error(f"--resume takes its settings from the run's config.json; drop "
                             f"{', '.join('--' + e.replace('_', '-') for e in extra)}")
            run_dir = Path(args.resume)
            cfg = load_config(run_dir / "config.json")
            cfg = cfg.replace(**{k: getattr(args, k) for k in RESUME_OVERRIDABLE if k in args})
            train(cfg, run_dir, resume=True, **run)
        else:
            try:
                cfg = resolve_config(args)
                cfg.validate()
            except ValueError as e:
                parser.error(str(e))
            refused = inapplicable_flags([k for k in vars(args) if k in fields], cfg.encoder)
            if refused:
                parser.error(refused)
            _note_gpu_sized_defaults_on_cpu(args)
            train(cfg, getattr(args, "run_dir", None), **run)
    except (RunDirError, TrainingDiverged, ConnectionError, FileNotFoundError, ValueError, VLLMError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 130 if stop.requested else 0


if __name__ == "__main__":
    sys.exit(main())

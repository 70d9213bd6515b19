"""python -m rl.offline train|eval: offline AWR on trajectory files (docs/OFFLINE.md)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from rl.cli import PROMPT_METAVAR, Parser, add_dataclass_options, prompt_text
from rl.config import read_mapping_file
from rl.offline.config import GROUPS, HIDDEN_MODES, RESIDENT, OfflineConfig

TRAIN_HELP = """Train an offline AWR policy on trajectory files (recorded by rl.train / rl.eval --save-trajectories,
labelled by rl.label, or the reference pipeline's). Returns-to-go run across file boundaries of a recording;
the dataset lives on the device when it fits (compact, lossless), else shards stream from a prefetching reader;
held-out files give a validation loss; checkpoints hold the hidden-state normalisation statistics."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m rl.offline", description=__doc__)
    sub = p.add_subparsers(dest="command", metavar="{train,eval}", parser_class=Parser)
    sub.required = True
    t = sub.add_parser("train", help="train an AWR policy", description=TRAIN_HELP,
                       argument_default=argparse.SUPPRESS)
    add_dataclass_options(t, OfflineConfig, GROUPS, choices={"hidden": HIDDEN_MODES, "resident": RESIDENT})
    t.add_argument("--config", type=Path, metavar="FILE", help="settings from a JSON/YAML file (e.g. a run's "
                   "config.json); flags override it")
    t.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a stopped or killed run exactly "
                   "(--steps may be raised)")
    t.add_argument("--track", action="store_true", help="log metrics to Weights & Biases")
    t.add_argument("--tensorboard", action="store_true", help="log metrics for TensorBoard (RUN_DIR/tensorboard)")
    t.add_argument("--quiet", action="store_true", help="print only errors and warnings")
    e = sub.add_parser("eval", help="play a trained policy in the game", description=_eval_doc())
    e.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory written by rl.offline train")
    e.add_argument("--episodes", type=int, default=128, metavar="N", help="episodes per mode (one per env)")
    e.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="hidden-state ablations (rl.modes: real zero noise shuffled other_prompt; default: real "
                        "zero shuffled for --hidden real, the training mode otherwise)")
    e.add_argument("--seed", type=int, default=1234, metavar="N",
                   help="seed of the evaluation worlds (the same for every mode)")
    e.add_argument("--max-steps", type=int, default=10_000, dest="max_steps", metavar="N",
                   help="stop an episode after this many steps (reported as unfinished)")
    e.add_argument("--system-prompt", default=None, dest="system_prompt", type=prompt_text, metavar=PROMPT_METAVAR,
                   help="the system prompt given to rl.label, for files labelled before the labelling metadata kept "
                        "its text: its text, or @FILE")
    e.add_argument("--prompt", action="append", default=[], metavar="NAME=TEXT|NAME=@FILE",
                   help="also play a prompt variant NAME: the system prompt replaced by TEXT or FILE's text (may "
                        "repeat); a column of the table, a bar of the chart, its text kept in eval.json")
    e.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="prompt variants from a YAML or JSON file (rl.variants: system text, drop a section, "
                        "fixed game text, random tokens, empty)")
    return p


def _eval_doc() -> str:
    from rl.offline import evaluate

    return evaluate.__doc__


def _train(args: argparse.Namespace) -> int:
    from rl.offline.train import resume_config, train
    from rl.tracking import TrackingOptions

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(OfflineConfig) if hasattr(args, f.name)}
    if getattr(args, "resume", None) is not None:
        cfg = resume_config(args.resume, given)
        resume = True
    else:
        settings = {}
        if getattr(args, "config", None) is not None:
            settings = _read_settings(args.config)
        cfg = OfflineConfig(**{**settings, **given})
        resume = False
    tracking = TrackingOptions(wandb=getattr(args, "track", False), tensorboard=getattr(args, "tensorboard", False))
    tracking.check_installed()
    from rl.interrupt import StopOnInterrupt

    out = Path(cfg.out) if cfg.out is not None else None
    fresh = not resume and out is not None and not out.exists()
    try:
        with StopOnInterrupt(lambda text: print("\n" + text, file=sys.stderr, flush=True)) as stop:
            train(cfg, resume=resume, quiet=getattr(args, "quiet", False), tracking=tracking, should_stop=stop)
    except BaseException:
        if fresh and out.exists() and not _has_checkpoint(out):  # nothing worth keeping: leave nothing behind
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    return 130 if stop.requested else 0  # stopped by Ctrl-C (checkpointed): as rl.train


def _has_checkpoint(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())


def _read_settings(path: Path) -> dict:
    d = read_mapping_file(path)
    if d.get("kind") == "offline-awr" and isinstance(d.get("settings"), dict):
        d = {k.replace("-", "_"): v for k, v in d["settings"].items()}  # a run's config.json
    names = {f.name for f in dataclasses.fields(OfflineConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"--config {path}: unknown settings {unknown} (python -m rl.offline train --help lists them)")
    d.pop("out", None)
    return d


def _eval(args: argparse.Namespace) -> int:
    from rl.eval_report import format_table, save_results
    from rl.offline.evaluate import evaluate
    from rl.progress import StatusLine
    from rl.variants import gather

    variants = gather(args.prompt, args.prompts)  # bad input: one line, before anything is loaded or written
    line = StatusLine(sys.stderr)
    try:
        results = evaluate(args.run_dir, args.episodes, args.modes, args.seed, args.max_steps, args.system_prompt,
                           line.say, line.update, variants=variants)
    finally:
        line.done()
    print(format_table(results))
    written, note = save_results(args.run_dir, results)  # merged with earlier modes of the same play, as rl.eval
    print(f"{written[0]}: {note}")
    print("wrote " + ", ".join(map(str, written)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":
        for flag, value in (("--episodes", args.episodes), ("--max-steps", args.max_steps)):
            if value < 1:
                parser.error(f"eval {flag} must be >= 1, got {value}")
    try:
        return _train(args) if args.command == "train" else _eval(args)
    except (ValueError, FileNotFoundError) as e:  # TrajectoryError, CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted" + ("; continue a training run with python -m rl.offline train --resume RUN_DIR if it "
                               "saved a checkpoint" if args.command == "train" else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

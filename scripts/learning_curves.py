"""Learning curves of issue 4 (Correctness), resumable across several 10-minute commands.

    python scripts/learning_curves.py --out curves/ --time-budget 540          # repeat until it says "all done"
    python scripts/learning_curves.py --out curves/ --only none-classic-30M-s0 # one run
    python scripts/learning_curves.py --out /tmp/lc --smoke                    # CPU check at tiny shapes

Runs (1,024 envs, reference hyperparameters, LR annealed over each run's whole budget):
    none-classic-30M-s{0,1}, none-symbolic-10M-s{0,1}: plain PPO vs the reference curve (REFERENCE §2)
    none-classic-10M-s0, inscan-classic-10M-s0 (tiny model, normalised fusion), inscan-raw-classic-10M-s0
    none-perenv-classic-10M-s0, none-perenv-symbolic-10M-s{0,1}: `--shuffle per_env` vs the reference shuffle
Each run is a normal run directory under --out (resumed with the trainer's own --resume logic); the script
trains the first unfinished run until --time-budget seconds are spent, checkpoints, and exits. When every run
is finished it writes the PNGs and summary.json (mean return at 10/25/50/75/100% of each run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.config import TrainConfig, load_config  # noqa: E402
from rl.plot import load_curves, plot_runs  # noqa: E402
from rl.rundir import Checkpoints  # noqa: E402
from rl.train import train  # noqa: E402

CLASSIC, SYM = "Craftax-Classic-Symbolic-v1", "Craftax-Symbolic-v1"
RUNS = {
    "none-classic-30M-s0": dict(env=CLASSIC, total_timesteps=30_000_000, seed=0),
    "none-classic-30M-s1": dict(env=CLASSIC, total_timesteps=30_000_000, seed=1),
    "none-symbolic-10M-s0": dict(env=SYM, total_timesteps=10_000_000, seed=0),
    "none-symbolic-10M-s1": dict(env=SYM, total_timesteps=10_000_000, seed=1),
    "none-classic-10M-s0": dict(env=CLASSIC, total_timesteps=10_000_000, seed=0),
    "inscan-classic-10M-s0": dict(env=CLASSIC, total_timesteps=10_000_000, seed=0, encoder="inscan", skip_n=1),
    "inscan-raw-classic-10M-s0": dict(env=CLASSIC, total_timesteps=10_000_000, seed=0, encoder="inscan", skip_n=1,
                                      fusion="raw"),
    # the device-local minibatch shuffle (issue 6) against the reference shuffle's runs above
    "none-perenv-classic-10M-s0": dict(env=CLASSIC, total_timesteps=10_000_000, seed=0, shuffle="per_env"),
    "none-perenv-symbolic-10M-s0": dict(env=SYM, total_timesteps=10_000_000, seed=0, shuffle="per_env"),
    "none-perenv-symbolic-10M-s1": dict(env=SYM, total_timesteps=10_000_000, seed=1, shuffle="per_env"),
}
FIGURES = {
    "classic_30M.png": ["none-classic-30M-s0", "none-classic-30M-s1"],
    "symbolic_10M.png": ["none-symbolic-10M-s0", "none-symbolic-10M-s1"],
    "classic_10M_llm.png": ["none-classic-10M-s0", "inscan-classic-10M-s0", "inscan-raw-classic-10M-s0"],
    "shuffle_classic_10M.png": ["none-classic-10M-s0", "none-perenv-classic-10M-s0"],
    "shuffle_symbolic_10M.png": ["none-symbolic-10M-s0", "none-symbolic-10M-s1", "none-perenv-symbolic-10M-s0",
                                 "none-perenv-symbolic-10M-s1"],
}
SMOKE = dict(num_envs=8, num_steps=8, num_minibatches=2, update_epochs=1, width=32, total_timesteps=8 * 8 * 4,
             checkpoint_every=2)


def run_config(name: str, smoke: bool) -> TrainConfig:
    cfg = TrainConfig(**dict(RUNS[name], checkpoint_every=100))
    return dataclasses.replace(cfg, **SMOKE, env=CLASSIC) if smoke else cfg


def is_finished(run_dir: Path) -> bool:
    if not (run_dir / "config.json").exists():
        return False
    cfg = load_config(run_dir / "config.json")
    ckpt = Checkpoints(run_dir)
    step = ckpt.latest_step()
    ckpt.close()
    return step is not None and step >= cfg.num_updates


def summary(run_dir: Path) -> dict:
    c = load_curves(run_dir)
    out = {}
    total = c["timestep"][-1]
    for frac in (0.1, 0.25, 0.5, 0.75, 1.0):
        window = (c["timestep"] <= frac * total) & (c["timestep"] > frac * total - 0.05 * total)
        vals = c["episode_return"][window]
        out[f"{int(frac * 100)}%"] = float(vals[vals == vals].mean()) if (vals == vals).any() else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="+", choices=sorted(RUNS), default=None)
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds of training in this call")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    names = args.only or list(RUNS)
    t0 = time.perf_counter()
    for name in names:
        run_dir = args.out / name
        if is_finished(run_dir):
            continue
        left = args.time_budget - (time.perf_counter() - t0)
        if left < 60 and not args.smoke:
            print(f"time budget spent; run again to continue ({name} next)")
            return 0
        cfg = run_config(name, args.smoke)
        resume = (run_dir / "config.json").exists()
        print(f"== {name}: {'resuming' if resume else 'starting'} ({cfg.num_updates} updates)", flush=True)
        train(cfg, run_dir, resume=resume, time_limit=left, quiet=True)
        if not is_finished(run_dir):
            print(f"time budget spent inside {name}; run again to continue")
            return 0
    print("all done")
    results = {}
    for name in names:
        results[name] = summary(args.out / name)
        print(name, results[name])
    (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    for png, runs in FIGURES.items():
        runs = [r for r in runs if r in names]
        if runs:
            print(plot_runs([args.out / r for r in runs], args.out / png, labels=runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

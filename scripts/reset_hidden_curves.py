"""Learning curves of the two reset policies (`--reset-hidden zero` vs `pool`) with long LLM windows, on a CPU.

    python scripts/reset_hidden_curves.py --out /tmp/lc                  # 3 seeds x 2 policies, ~25 min on 2 cores
    python scripts/reset_hidden_curves.py --out /tmp/lc --seeds 0 --total-timesteps 8192   # a quick look

Each run is `python -m rl.train --encoder inscan --preset cpu --skip-n 100 --reset-hidden POLICY --seed S
--total-timesteps N --run-dir OUT/POLICY-sS` (Classic, 32 envs x 32 steps, the tiny Qwen3 with random weights);
a finished run is not trained again. Then it writes OUT/reset_hidden.png (every run's curves) and
OUT/summary.json: per policy and seed, the mean episode return over each quarter of the run (weighted by the
episodes that ended in it), `hidden_zero_frac` averaged over the run, and the LLM prompts per window.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.config import load_config  # noqa: E402
from rl.plot import plot_runs  # noqa: E402
from rl.train import main as train_main  # noqa: E402
from scripts.learning_curves import is_finished  # noqa: E402

POLICIES = ("zero", "pool")


def train_flags(policy: str, seed: int, total_timesteps: int, skip_n: int, run_dir: Path) -> list[str]:
    return ["--encoder", "inscan", "--preset", "cpu", "--skip-n", str(skip_n), "--reset-hidden", policy,
            "--seed", str(seed), "--total-timesteps", str(total_timesteps), "--run-dir", str(run_dir), "--quiet"]


def run_summary(run_dir: Path) -> dict:
    """Episode return per quarter (episode-weighted), hidden_zero_frac, prompts per window of one finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = load_config(run_dir / "config.json")
    returns = np.array([r["episode_return"] if r["episode_return"] is not None else np.nan for r in rows])
    episodes = np.array([r["episodes"] for r in rows], dtype=float)
    quarters = {}
    for q, part in enumerate(np.array_split(np.arange(len(rows)), 4)):
        weights = np.where(np.isnan(returns[part]), 0.0, episodes[part])
        quarters[f"Q{q + 1}"] = float(np.nansum(returns[part] * weights) / weights.sum()) if weights.sum() else None
    pool_prompts = cfg.num_envs // cfg.reset_ratio if cfg.hidden_on_reset == "pool" else 0
    return {"return_by_quarter": quarters, "episodes": int(episodes.sum()),
            "hidden_zero_frac": float(np.mean([r["hidden_zero_frac"] for r in rows])),
            "prompts_per_window": cfg.num_envs + pool_prompts, "updates": len(rows)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the run directories and the summary")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (each policy runs each)")
    parser.add_argument("--total-timesteps", type=int, default=409_600, help="env steps per run (400 updates)")
    parser.add_argument("--skip-n", type=int, default=100, help="LLM window length in env steps")
    args = parser.parse_args(argv)

    runs = {}
    for seed in args.seeds:
        for policy in POLICIES:
            run_dir = args.out / f"{policy}-s{seed}"
            if not (run_dir / "config.json").exists():
                flags = train_flags(policy, seed, args.total_timesteps, args.skip_n, run_dir)
            elif not is_finished(run_dir):
                flags = ["--resume", str(run_dir), "--quiet"]  # stopped part way
            else:
                flags = None
            if flags and train_main(flags) != 0:
                raise SystemExit(f"training {run_dir} failed")
            runs[run_dir.name] = run_summary(run_dir)
            print(run_dir.name, json.dumps(runs[run_dir.name]), flush=True)
    means = {}
    for policy in POLICIES:
        mine = [r for name, r in runs.items() if name.startswith(policy)]
        for q in ("Q1", "Q2", "Q3", "Q4"):
            values = [r["return_by_quarter"][q] for r in mine if r["return_by_quarter"][q] is not None]
            means.setdefault(policy, {})[q] = float(np.mean(values)) if values else None
        means[policy]["hidden_zero_frac"] = float(np.mean([r["hidden_zero_frac"] for r in mine]))
    summary = {"runs": runs, "mean_over_seeds": means, "flags": train_flags("POLICY", -1, args.total_timesteps,
                                                                              args.skip_n, Path("DIR"))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_runs([args.out / name for name in runs], args.out / "reset_hidden.png", smooth=20, labels=list(runs))
    print(json.dumps(means, indent=2))
    return summary


if __name__ == "__main__":
    main()

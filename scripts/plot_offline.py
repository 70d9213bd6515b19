"""Curves of offline AWR runs (docs/OFFLINE.md's learning check): training loss terms and the held-out files'
losses against updates, and, where the runs (and an online reference run) have an eval.json, their mean
returns.

    python scripts/plot_offline.py RUN_DIR [RUN_DIR ...] [--reference PPO_RUN_DIR] --out docs/curves/offline.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _eval(run: Path) -> dict | None:
    path = run / "eval.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--reference", type=Path, default=None, help="an online run directory with an eval.json")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run in a.runs:
        recs = _records(run)
        u = [r["update"] for r in recs]
        axes[0].plot(u, [r["nll"] for r in recs], label=f"{run.name} train")
        if "val_nll" in recs[0]:
            axes[0].plot(u, [r["val_nll"] for r in recs], "--", label=f"{run.name} held out")
        axes[1].plot(u, [r["value_loss"] for r in recs], label=f"{run.name} train")
        if "val_value_loss" in recs[0]:
            axes[1].plot(u, [r["val_value_loss"] for r in recs], "--", label=f"{run.name} held out")
    axes[0].set(title="-log pi(a|s) of the data's actions", xlabel="update")
    axes[1].set(title="value MSE to the return-to-go", xlabel="update")
    names, means, errs = [], [], []
    for run in ([a.reference] if a.reference else []) + list(a.runs):
        res = _eval(run)
        if res is None:
            continue
        r = res.get("real") or next(iter(res.values()))
        names.append(run.name)
        means.append(r["return_mean"])
        errs.append(r["return_stderr"])
    if names:
        axes[2].bar(names, means, yerr=errs, capsize=5, color=["tab:gray"] + ["tab:blue"] * (len(names) - 1)
                    if a.reference else "tab:blue")
        axes[2].set(title="mean episode return in the game (± s.e.)")
        axes[2].tick_params(axis="x", labelrotation=15)
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=80)
    print(f"wrote {a.out}")
    return a.out


if __name__ == "__main__":
    main()

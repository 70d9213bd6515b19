"""Learning curves of run directories: `load_curves` (metrics.jsonl as arrays) and `plot_runs` (curves.png).

The library under `python -m rl.plot` and the trainer's end-of-run chart (`rl.loop`). Three panels against env
steps: episode return, mean achievement rate (over all achievements), and SPS. Return and achievement curves are
smoothed with a moving average over `smooth` updates (updates where no episode ended are skipped); SPS is not
smoothed and leaves out each invocation's first update, which also compiled.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rl.rundir import MetricsLog


def load_curves(run_dir: Path) -> dict[str, np.ndarray]:
    rows = MetricsLog(Path(run_dir) / "metrics.jsonl").read()
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty")
    get = lambda k: np.array([np.nan if r.get(k) is None else r[k] for r in rows], float)
    ach = np.array([_mean_or_nan((r.get("achievements") or {}).values()) for r in rows], float)
    compiled = np.array([bool(r.get("first_call_includes_compile")) for r in rows])
    return {"timestep": get("timestep"), "episode_return": get("episode_return"), "achievement_rate": ach,
            "sps": np.where(compiled, np.nan, get("sps"))}


def _mean_or_nan(values) -> float:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else float("nan")


def _smooth(x: np.ndarray, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(y)
    x, y = x[keep], y[keep]
    if k > 1 and len(y) >= k:
        y = np.convolve(y, np.ones(k) / k, mode="valid")
        x = x[k - 1:]
    return x, y


def plot_runs(run_dirs, out: Path, smooth: int = 10, labels=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    avg = f"moving average of {smooth} updates" if smooth > 1 else "not smoothed"
    panels = [("episode_return", "episode return", f"mean episode return ({avg})", "return"),
              ("achievement_rate", "mean achievement rate", f"share of episodes, mean over achievements ({avg})",
               "rate"),
              ("sps", "speed", "env steps per second (each start's compiling update left out)", "SPS")]
    names = []
    for i, run_dir in enumerate(run_dirs):
        curves = load_curves(run_dir)
        label = labels[i] if labels else Path(run_dir).name
        names.append(label)
        for ax, (key, title, subtitle, ylabel) in zip(axes, panels):
            x, y = _smooth(curves["timestep"], curves[key], 1 if key == "sps" else smooth)
            ax.plot(x, y, label=label, marker="." if len(x) < 30 else None)
            if len(x) == 0 and i == 0:
                ax.text(0.5, 0.5, "no episode has ended yet" if key != "sps" else "only compiling updates",
                        ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_title(f"{title}\n{subtitle}", fontsize=9)
            ax.set_xlabel("env steps")
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, 10M: long step counts do not collide
            ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle(names[0] if len(names) == 1 else f"{len(names)} runs: " + ", ".join(names)[:150], fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

"""Learning curves of run directories: `load_curves` (metrics.jsonl as arrays) and `plot_runs` (curves.png).

The library under `python -m rl.plot` and the trainer's end-of-run chart (`rl.loop`). Three panels against env
steps: episode return, mean achievement rate (over all achievements), and SPS. Return and achievement curves are
smoothed with a moving average over `smooth` updates (updates where no episode ended are skipped); SPS is not
smoothed and leaves out each invocation's first update, which also compiled. Offline AWR runs:
`load_offline_curves` / `plot_offline_runs` (losses on training and held-out files, and eval.json's modes).
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


OFFLINE_KEYS = ("nll", "value_loss", "val_nll", "val_value_loss", "val_accuracy")


def load_offline_curves(run_dir: Path) -> dict:
    """An offline run's records as arrays against `update` (NaN where a record lacks a key), and its eval.json
    (`evaluation`, None when it was not evaluated)."""
    import json

    rows = MetricsLog(Path(run_dir) / "metrics.jsonl").read()
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty")
    get = lambda k: np.array([np.nan if r.get(k) is None else r[k] for r in rows], float)
    out = {k: get(k) for k in ("update",) + OFFLINE_KEYS}
    try:
        out["evaluation"] = json.loads((Path(run_dir) / "eval.json").read_text())
    except (OSError, ValueError):
        out["evaluation"] = None
    return out


def plot_offline_runs(run_dirs, out: Path, labels=None) -> Path:
    """The curves of offline AWR runs (the module docstring) written to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    bars: list[tuple[str, float, float]] = []
    names = []
    for i, run_dir in enumerate(run_dirs):
        c = load_offline_curves(run_dir)
        label = labels[i] if labels else Path(run_dir).name
        names.append(label)
        for ax, (train, held) in zip(axes, (("nll", "val_nll"), ("value_loss", "val_value_loss"))):
            line, = ax.plot(c["update"], c[train], label=f"{label} training files", marker=".")
            if np.isfinite(c[held]).any():
                ax.plot(c["update"], c[held], "--", color=line.get_color(), label=f"{label} held-out files",
                        marker=".")
        for mode, r in (c["evaluation"] or {}).items():
            bars.append((f"{label}\n{mode}" if len(run_dirs) > 1 else mode, r["return_mean"], r["return_stderr"]))
    axes[0].set_title("policy: -log pi(a|s) of the data's actions (nats)\ntraining vs held-out files", fontsize=9)
    axes[1].set_title("value: mean squared error to the return-to-go\ntraining vs held-out files", fontsize=9)
    for ax in axes[:2]:
        ax.set_xlabel("update")
        ax.legend(fontsize=7)
    ax = axes[2]
    if bars:
        ax.bar([b[0] for b in bars], [b[1] for b in bars], yerr=[b[2] for b in bars], capsize=5,
               color=["tab:blue" if b[0].endswith("real") else "tab:gray" for b in bars])
        ax.axhline(0, color="black", linewidth=0.5)
        ax.tick_params(axis="x", labelsize=8)
    else:
        ax.text(0.5, 0.5, "not evaluated yet:\npython -m rl.offline eval RUN_DIR", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.set_title("in the game: mean episode return per mode\n(± standard error; eval.json of rl.offline eval)",
                 fontsize=9)
    fig.suptitle(names[0] if len(names) == 1 else f"{len(names)} offline runs: " + ", ".join(names)[:150],
                 fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

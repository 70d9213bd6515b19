"""How rl.eval shows its results: an aligned, explained table and a bar chart of the ablations."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rl.files import atomic_write
from rl.modes import MEANINGS as MODE_MEANING  # the one table of modes (rl.modes)
from rl.verdict import RELIES, THRESHOLD, add_verdicts


def format_table(results: dict[str, dict[str, Any]], meaning: dict[str, str] | None = None) -> str:
    """The results of `rl.eval.evaluate` as an aligned table, with what its columns and rows mean (`meaning`: what
    each mode fed the policy, default rl.modes' table). Entries with per-episode data get their 95% intervals and,
    beside `real`, the paired difference and verdict (`rl.verdict.add_verdicts`)."""
    meaning = meaning or MODE_MEANING
    results = add_verdicts(results)
    cis = any("return_ci95" in r for r in results.values())
    width = max(len("hidden state"), *(len(m) for m in results))
    head = f"{'hidden state':<{width}}  {'episodes':>8}  {'return':>15}  {'length':>8}  "
    if cis:
        head += f"{'95% interval':>17}  {'ach. rate':>9}  {'vs real: return diff [95%]':<34}  {'verdict':<20}  "
    head += "top achievements"
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        top = sorted(r["achievements"].items(), key=lambda kv: -kv[1])[:4]
        ach = ", ".join(f"{k} {v:.0%}" for k, v in top if v > 0) or "none"
        ret = f"{r['return_mean']:.2f} ± {r['return_stderr']:.2f}"
        extra = f"  ({r['unfinished']} unfinished)" if r["unfinished"] else ""
        row = f"{mode:<{width}}  {r['episodes']:>8d}  {ret:>15}  {r['length_mean']:>8.1f}  "
        if cis:
            lo, hi = r.get("return_ci95", (float("nan"),) * 2)
            vs = r.get("vs_real")
            diff = (f"{vs['return_diff']:+.2f} [{vs['return_diff_ci95'][0]:+.2f}, {vs['return_diff_ci95'][1]:+.2f}]"
                    if vs else "-")
            row += (f"{f'[{lo:.2f}, {hi:.2f}]':>17}  {r.get('achievement_rate', float('nan')):>9.1%}  {diff:<34}  "
                    f"{(vs['return_verdict'] if vs else '-'):<20}  ")
        lines.append(f"{row}{ach}{extra}")
    lines.append("return: mean episode return ± its standard error (std / sqrt(episodes)); every mode plays the "
                 "same worlds (same seeds).")
    if cis:
        lines.append("95% interval: percentile bootstrap over episodes; ach. rate: mean share of achievements "
                     "unlocked per episode; vs real: paired difference (mode - real) on the same worlds.")
        lines.append(THRESHOLD + "; the same rule for achievement rates:")
        for mode, r in results.items():
            vs = r.get("vs_real")
            if vs:
                lo, hi = vs["achievement_rate_diff_ci95"]
                lost = [n for n, a in vs.get("achievements", {}).items() if a["verdict"] == RELIES]
                lines.append(f"  {mode:<{width}}  achievement rate {vs['achievement_rate_diff']:+.1%} [{lo:+.1%}, "
                             f"{hi:+.1%}]: {vs['achievement_rate_verdict']}"
                             + (f" (fewer: {', '.join(lost)})" if lost else ""))
    if len(results) > 1:
        lines += ["rows (what the policy read as its LLM input):"] + [
            f"  {m:<{width}}  {(r.get('variant') or {}).get('note') or meaning.get(m, m)}"
            for m, r in results.items()]
        lines.append("An ablation within about two standard errors of `real` means the policy does not rely on "
                     "that part of the LLM's hidden state; far below `real` means it does.")
    return "\n".join(lines)


def plot_ablations(results: dict[str, dict[str, Any]], out: Path, title: str) -> Path:
    """Bar chart of the mean return per mode with ±1 standard error, written to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = add_verdicts(results)
    modes = list(results)
    means = np.array([results[m]["return_mean"] for m in modes])
    cis = all("return_ci95" in results[m] for m in modes)
    if cis:  # asymmetric bars: the 95% bootstrap interval
        lo = np.array([results[m]["return_ci95"][0] for m in modes])
        hi = np.array([results[m]["return_ci95"][1] for m in modes])
        errors = np.stack([np.maximum(means - lo, 0), np.maximum(hi - means, 0)])
    else:
        errors = np.array([results[m]["return_stderr"] for m in modes])
    fig, ax = plt.subplots(figsize=(1.4 * len(modes) + 2.5, 4))
    colors = ["tab:blue" if m == "real" else
              "tab:red" if results[m].get("vs_real", {}).get("return_verdict") == RELIES else "tab:gray"
              for m in modes]
    ax.bar(modes, means, yerr=errors, capsize=5, color=colors)
    ax.set_ylabel("mean episode return (95% interval)" if cis else "mean episode return (± standard error)")
    if cis:
        ax.tick_params(axis="x", labelrotation=20)
    ax.set_xlabel("hidden state fed to the policy")
    episodes = results[modes[0]]["episodes"]
    ax.set_title(f"{title}: {episodes} episodes per mode", fontsize=10)
    ax.axhline(0, color="black", linewidth=0.5)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))  # never seen half written
    finally:
        plt.close(fig)
    return out


RESULTS_FILE = "eval.json"
CHART_FILE = "eval_ablations.png"
# what makes two modes' results comparable (system_prompt: the text the LLM read behind; None without an LLM)
SAME_PLAY = ("checkpoint", "seed", "episodes", "max_steps", "system_prompt")


def merge_results(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> tuple[dict, str]:
    """`new` modes added to (or replacing) those of `old` that were played the same way (same checkpoint, seed,
    episode count, step limit and system prompt: `SAME_PLAY` in each mode's entry); `old` is dropped when they differ. Returns the
    merged results (every mode of MODE_MEANING order first) and a line saying what happened."""
    if not new:
        return dict(old), "nothing new"
    play = {k: next(iter(new.values())).get(k) for k in SAME_PLAY}
    kept = {m: r for m, r in old.items() if m not in new and all(r.get(k) == v for k, v in play.items())}
    dropped = [m for m in old if m not in new and m not in kept]
    merged = {**kept, **new}
    order = [m for m in MODE_MEANING if m in merged] + [m for m in merged if m not in MODE_MEANING]
    merged = {m: merged[m] for m in order}
    said = [f"{', '.join(new)} written"]
    if kept:
        said.append(f"kept {', '.join(kept)} of the same checkpoint and seed")
    if dropped:
        said.append(f"dropped {', '.join(dropped)} (played with another checkpoint, seed, --episodes, --max-steps or "
                    f"system prompt)")
    return merged, "; ".join(said)


def save_results(run_dir: Path, results: dict[str, dict[str, Any]]) -> tuple[list[Path], str]:
    """Merge `results` into `run_dir`/eval.json (`merge_results`; written atomically) and redraw
    eval_ablations.png from everything the file then holds (removed when it holds a single mode). Returns the files
    written and the merge's line."""
    run_dir = Path(run_dir)
    path = run_dir / RESULTS_FILE
    old: dict = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        if not isinstance(old, dict) or not all(isinstance(r, dict) for r in old.values()):
            old = {}
    merged, note = merge_results(old, results)
    merged = add_verdicts(merged)
    atomic_write(path, json.dumps(merged, indent=2) + "\n")
    written = [path]
    chart = run_dir / CHART_FILE
    if len(merged) > 1:
        written.append(plot_ablations(merged, chart, run_dir.name))
    elif chart.exists():
        chart.unlink()
        note += f"; removed {CHART_FILE} (it showed modes no longer in {RESULTS_FILE})"
    return written, note

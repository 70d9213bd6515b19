"""How rl.eval shows its results: an aligned, explained table and a bar chart of the ablations."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MODE_MEANING = {
    "real": "the hidden states the policy was trained with",
    "zeros": "all-zero hidden states",
    "noise": "Gaussian noise with the real states' mean and std",
    "shuffled": "another env's real hidden state",
    "other_prompt": "the real model behind another system prompt",
}


def format_table(results: dict[str, dict[str, Any]], meaning: dict[str, str] | None = None) -> str:
    """The results of `rl.eval.evaluate` as an aligned table, with what its columns and rows mean (`meaning`: what
    each mode fed the policy, default MODE_MEANING: rl.eval's)."""
    meaning = meaning or MODE_MEANING
    width = max(len("hidden state"), *(len(m) for m in results))
    head = f"{'hidden state':<{width}}  {'episodes':>8}  {'return':>15}  {'length':>8}  top achievements"
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        top = sorted(r["achievements"].items(), key=lambda kv: -kv[1])[:4]
        ach = ", ".join(f"{k} {v:.0%}" for k, v in top if v > 0) or "none"
        ret = f"{r['return_mean']:.2f} ± {r['return_stderr']:.2f}"
        extra = f"  ({r['unfinished']} unfinished)" if r["unfinished"] else ""
        lines.append(f"{mode:<{width}}  {r['episodes']:>8d}  {ret:>15}  {r['length_mean']:>8.1f}  {ach}{extra}")
    lines.append("return: mean episode return ± its standard error (std / sqrt(episodes)); every mode plays the "
                 "same worlds (same seeds).")
    if len(results) > 1:
        lines += ["rows (what the policy read as its LLM input):"] + [
            f"  {m:<{width}}  {meaning.get(m, m)}" for m in results]
        lines.append("An ablation within about two standard errors of `real` means the policy does not rely on "
                     "that part of the LLM's hidden state; far below `real` means it does.")
    return "\n".join(lines)


def plot_ablations(results: dict[str, dict[str, Any]], out: Path, title: str) -> Path:
    """Bar chart of the mean return per mode with ±1 standard error, written to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    means = [results[m]["return_mean"] for m in modes]
    errors = [results[m]["return_stderr"] for m in modes]
    fig, ax = plt.subplots(figsize=(1.4 * len(modes) + 2.5, 4))
    colors = ["tab:blue" if m == "real" else "tab:gray" for m in modes]
    ax.bar(modes, means, yerr=errors, capsize=5, color=colors)
    ax.set_ylabel("mean episode return (± standard error)")
    ax.set_xlabel("hidden state fed to the policy")
    episodes = results[modes[0]]["episodes"]
    ax.set_title(f"{title}: {episodes} episodes per mode", fontsize=10)
    ax.axhline(0, color="black", linewidth=0.5)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, out)  # a chart is never seen half written
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(tmp, path)
    written = [path]
    chart = run_dir / CHART_FILE
    if len(merged) > 1:
        written.append(plot_ablations(merged, chart, run_dir.name))
    elif chart.exists():
        chart.unlink()
        note += f"; removed {CHART_FILE} (it showed modes no longer in {RESULTS_FILE})"
    return written, note

"""How rl.eval shows its results: an aligned, explained table and a bar chart of the ablations."""
from __future__ import annotations

from pathlib import Path
from typing import Any

MODE_MEANING = {
    "real": "the hidden states the policy was trained with",
    "zeros": "all-zero hidden states",
    "noise": "Gaussian noise with the real states' mean and std",
    "shuffled": "another env's real hidden state",
    "other_prompt": "the real model behind another system prompt",
}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The results of `rl.eval.evaluate` as an aligned table, with what its columns and rows mean."""
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
            f"  {m:<{width}}  {MODE_MEANING.get(m, m)}" for m in results]
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
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

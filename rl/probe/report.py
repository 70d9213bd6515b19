"""How the probe shows its results: the aligned table, probe.json (the contract), probe_details.json, probe.png
and the --show texts side by side. Every file is written atomically (a temporary name, then renamed)."""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from rl.files import atomic_write
from rl.modes import MEANINGS  # the one table of modes (rl.modes)

# what each mode means for a PAIR (both sides); the mode itself is rl.modes' (noise: one draw for both sides)
MODE_MEANING = dict(MEANINGS, noise=MEANINGS["noise"] + ", one draw shared by both sides of a pair",
                    shuffled="each side reads the real vector of the same side of another pair (rolled by one)")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(run: str, probe: dict[str, Any]) -> str:
    """One run's results as an aligned table (kind x mode), with what the columns mean."""
    rows = [("kind", "sign", "mode", "n", "skip", "mean dV", "median", "p10", "p90", "sign ok", "KL", "top chg")]
    for name, r in probe["kinds"].items():
        for j, (mode, s) in enumerate(r.modes.items()):
            first = j == 0
            rows.append((name if first else "", f"{r.expected_sign:+d}" if first else "", mode, str(s["n"]),
                         str(r.skipped) if first else "", _fmt(s["mean_dv"], "+.4f"), _fmt(s["median_dv"], "+.4f"),
                         _fmt(s["p10_dv"], "+.4f"), _fmt(s["p90_dv"], "+.4f"), _fmt(s["sign_correct"], ".2f"),
                         _fmt(s["kl"], ".4f"), _fmt(s["top_changed"], ".2f")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [f"probe of {run}"]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("-" * len(lines[-1]))
    lines.append("dV = V(high) - V(low) per pair; sign ok: fraction with sign(dV) = the kind's expected sign; KL: "
                 "mean KL(pi_low || pi_high); top chg: fraction whose most likely action differs; skip: pairs that "
                 "could not be built on their base state.")
    if probe["not_built"]:
        lines.append("not built: " + "; ".join(f"{k} ({v})" for k, v in probe["not_built"].items()))
    modes = {m for r in probe["kinds"].values() for m in r.modes}
    if len(modes) > 1:
        lines += ["modes (hidden state the policy read):"] + [f"  {m:<13} {MODE_MEANING[m]}" for m in MODE_MEANING
                                                             if m in modes]
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> Path:
    return atomic_write(path, text)


def contract_json(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """probe.json: {"runs": [{"run": PATH, "kinds": {KIND: {"expected_sign", "modes": {MODE: {n, mean_dv,
    median_dv, p10_dv, p90_dv, sign_correct, kl}}}}}]}."""
    return {"runs": [{"run": run, "kinds": {k: r.contract() for k, r in probe["kinds"].items()}}
                     for run, probe in runs]}


def details_json(runs: list[tuple[str, dict[str, Any]]], extra: dict[str, Any]) -> dict[str, Any]:
    """probe_details.json: what probe.json's contract leaves out (pairs built and skipped, top-action change,
    kinds not built, value diagnostics, settings)."""
    return {"runs": [{"run": run, "kinds": {k: r.details() for k, r in probe["kinds"].items()},
                      "not_built": probe["not_built"], **({"value": probe["value"]} if "value" in probe else {})}
                     for run, probe in runs], **extra}


def plot(runs: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    """Per kind, the mean value change (bars, p10-p90 whiskers) under each mode; one panel per run, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = list(dict.fromkeys(k for _, p in runs for k in p["kinds"]))
    signs = {k: r.expected_sign for _, p in runs for k, r in p["kinds"].items()}
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 0.28 * len(kinds) * 1.5 + 2), squeeze=False,
                             sharey=True)
    for ax, (run, probe) in zip(axes[0], runs):
        modes = list(dict.fromkeys(m for r in probe["kinds"].values() for m in r.modes))
        h = 0.8 / max(1, len(modes))
        for j, mode in enumerate(modes):
            means, lo, hi = [], [], []
            for k in kinds:
                s = probe["kinds"][k].modes.get(mode) if k in probe["kinds"] else None
                ok = s is not None and s["n"]
                means.append(s["mean_dv"] if ok else np.nan)
                lo.append(s["mean_dv"] - s["p10_dv"] if ok else 0)
                hi.append(s["p90_dv"] - s["mean_dv"] if ok else 0)
            y = np.arange(len(kinds)) + (j - (len(modes) - 1) / 2) * h
            ax.barh(y, means, height=h, xerr=np.maximum([lo, hi], 0), label=mode, capsize=1.5, error_kw={"lw": 0.5})
        ax.axvline(0, color="black", lw=0.5)
        ax.set_yticks(np.arange(len(kinds)))
        ax.set_yticklabels([f"{k} ({'+' if signs[k] > 0 else '-'})" for k in kinds], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("V(high) - V(low): mean, p10-p90")
        ax.set_title(Path(run).name, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        return atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)


def side_by_side(low: str, high: str, width: int = 64) -> str:
    """Two texts in two columns; lines that differ are marked with '*'."""
    a, b = low.splitlines(), high.splitlines()
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for k in range(max(i2 - i1, j2 - j1)):
            left = a[i1 + k] if i1 + k < i2 else ""
            right = b[j1 + k] if j1 + k < j2 else ""
            mark = " " if tag == "equal" else "*"
            out.append(f"{mark} {left[:width]:<{width}} | {right[:width]}")
    return "\n".join(out)


def show_text(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The --show file: every kind's first pairs, low text beside high text."""
    parts = []
    for run, probe in runs:
        for name, r in probe["kinds"].items():
            for i, (low, high) in enumerate(r.texts):
                parts.append(f"=== {run} | {name} | pair {i} | {r.doc} | left: low, right: high\n"
                             + side_by_side(low, high))
    return "\n\n".join(parts) + "\n"


def write_json(path: Path, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2) + "\n")

"""Does a policy rely on its LLM hidden state? Means with 95% intervals, and paired bootstrap differences from
`real`, with a verdict per mode or prompt variant (rl.eval, rl.offline eval).

Every mode plays the same worlds (env i starts from the same seed in every mode), so episode i of a mode is paired
with episode i of `real`: the difference is bootstrapped over episodes (the same resampled episodes for both),
which removes the worlds' own variance from the comparison.

The verdict's threshold, stated in every table: a mode **relies on the LLM** when the 95% interval of its paired
difference from `real` (mode - real) lies entirely below zero, i.e. replacing the LLM's reading costs return (or
achievements) beyond what resampling the episodes explains; otherwise there is **no evidence it does**.
"""
from __future__ import annotations

from typing import Any

import numpy as np

LEVEL = 0.95
BOOTSTRAPS = 2000
SEED = 0
RELIES, NO_EVIDENCE = "relies on the LLM", "no evidence it does"
THRESHOLD = ("verdict: 'relies on the LLM' when the 95% paired-bootstrap interval of (mode - real) over the same "
             "worlds lies entirely below 0; else 'no evidence it does'")


def _resamples(n: int, boots: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(boots, n))


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def mean_interval(x, level: float = LEVEL, boots: int = BOOTSTRAPS, seed: int = SEED) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `x` and its percentile-bootstrap interval over the episodes."""
    x = np.asarray(x, np.float64)
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    means = x[_resamples(len(x), boots, seed)].mean(1)
    return (float(x.mean()), *_interval(means, level))


def paired_difference(real, other, level: float = LEVEL, boots: int = BOOTSTRAPS,
                      seed: int = SEED) -> tuple[float, float, float]:
    """(mean of other - real, low, high): the paired difference over the same episodes, bootstrapped by resampling
    episode indices (the same for both). `real` and `other` [N] (or [N, K]: one interval per column)."""
    real, other = np.asarray(real, np.float64), np.asarray(other, np.float64)
    if real.shape != other.shape:
        raise ValueError(f"paired samples must have one shape, got {real.shape} and {other.shape}")
    d = other - real
    means = d[_resamples(len(d), boots, seed)].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return d.mean(0), lo, hi


def verdict(high: float) -> str:
    """The verdict of a difference (mode - real) whose interval ends at `high`."""
    return RELIES if high < 0 else NO_EVIDENCE


def _episodes(entry: dict) -> tuple[np.ndarray, np.ndarray] | None:
    if "episode_returns" not in entry or "episode_achievements" not in entry:
        return None
    ach = np.asarray(entry["episode_achievements"], np.float64)
    return np.asarray(entry["episode_returns"], np.float64), ach.reshape(len(entry["episode_returns"]), -1)


def add_verdicts(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`results` (mode -> entry with per-episode `episode_returns` [N] and `episode_achievements` [N, A] 0/1) with
    each entry's `return_ci95` and `achievement_rate` (+ `_ci95`: the mean share of achievements unlocked per
    episode) and, for every mode but `real`, `vs_real`: the paired differences of the return, of the achievement
    rate and of each achievement's rate, with intervals and verdicts. Entries without per-episode data, or played
    on other episodes than `real`, are left as they are."""
    out = {m: dict(r) for m, r in results.items()}
    base = _episodes(out["real"]) if "real" in out else None
    names = list(out["real"].get("achievements", {})) if "real" in out else []
    for mode, entry in out.items():
        ep = _episodes(entry)
        if ep is None:
            continue
        returns, ach = ep
        _, lo, hi = mean_interval(returns)
        entry["return_ci95"] = [lo, hi]
        rate = ach.mean(1) if ach.shape[1] else np.zeros(len(returns))
        m, lo, hi = mean_interval(rate)
        entry["achievement_rate"], entry["achievement_rate_ci95"] = m, [lo, hi]
        if mode == "real" or base is None or base[0].shape != returns.shape or base[1].shape != ach.shape:
            continue
        d, lo, hi = paired_difference(base[0], returns)
        vs = {"return_diff": float(d), "return_diff_ci95": [float(lo), float(hi)], "return_verdict": verdict(hi)}
        base_rate = base[1].mean(1) if base[1].shape[1] else np.zeros(len(returns))
        d, lo, hi = paired_difference(base_rate, rate)
        vs.update(achievement_rate_diff=float(d), achievement_rate_diff_ci95=[float(lo), float(hi)],
                  achievement_rate_verdict=verdict(hi))
        if ach.shape[1] and len(names) == ach.shape[1]:
            d, lo, hi = paired_difference(base[1], ach)
            vs["achievements"] = {n: {"diff": float(d[i]), "ci95": [float(lo[i]), float(hi[i])],
                                      "verdict": verdict(hi[i])} for i, n in enumerate(names)}
        vs["threshold"] = THRESHOLD
        entry["vs_real"] = vs
    return out

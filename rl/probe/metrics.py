"""Numbers of the probe: per kind and mode statistics of V(high) - V(low) and of the policy's change, and value
diagnostics (the critic against the discounted return-to-go of recorded trajectories). Plain numpy."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import rankdata

from rl.returns import stream_returns

STAT_KEYS = ("n", "mean_dv", "median_dv", "p10_dv", "p90_dv", "sign_correct", "kl")


def kl_divergence(logp_p: np.ndarray, logp_q: np.ndarray) -> np.ndarray:
    """KL(p || q) over the last axis of two log-probability arrays."""
    return np.sum(np.exp(logp_p) * (logp_p - logp_q), axis=-1)


def pair_stats(v_low, v_high, logp_low, logp_high, ok, expected_sign: int) -> dict[str, Any]:
    """The contract's statistics of one kind and mode over the pairs where `ok` (None values when n = 0):
    n, mean/median/p10/p90 of dv = V(high) - V(low), sign_correct = fraction with sign(dv) == expected_sign
    (dv = 0 counts as wrong), kl = mean KL(pi_low || pi_high); plus top_changed, the fraction whose most
    likely action differs (kept out of probe.json by the caller)."""
    ok = np.asarray(ok, bool)
    dv = (np.asarray(v_high, np.float64) - np.asarray(v_low, np.float64))[ok]
    n = int(ok.sum())
    if n == 0:
        return {"n": 0, **{k: None for k in STAT_KEYS[1:]}, "top_changed": None}
    kl = np.maximum(kl_divergence(np.asarray(logp_low, np.float64), np.asarray(logp_high, np.float64))[ok], 0.0)
    top = np.argmax(logp_low, -1)[ok] != np.argmax(logp_high, -1)[ok]
    return {"n": n, "mean_dv": float(dv.mean()), "median_dv": float(np.median(dv)),
            "p10_dv": float(np.percentile(dv, 10)), "p90_dv": float(np.percentile(dv, 90)),
            "sign_correct": float(np.mean(np.sign(dv) == expected_sign)), "kl": float(kl.mean()),
            "top_changed": float(top.mean())}


# --------------------------------------------------------------------------------------- value diagnostics

def load_trajectories(directory: Path, env: str) -> dict[str, Any]:
    """All trajectory files of `directory` (sorted by name: the stream's order) joined: obs, next_obs, reward,
    done and num_envs (from `recording`, else 1).
    ValueError (one line) for a directory without files or of another env."""
    from rl.trajectories import load_arrays, trajectory_env

    files = sorted(Path(directory).glob("*.npz"))
    if not files:
        raise ValueError(f"{directory} holds no trajectory files (*.npz); record some with "
                         f"`python -m rl.eval RUN_DIR --save-trajectories {directory}`")
    parts, num_envs = [], None
    for f in files:
        try:
            arrays, meta = load_arrays(f)
        except ValueError as e:  # TrajectoryError: say which file
            raise ValueError(f"{f}: {e}") from None
        got = trajectory_env(arrays, meta)
        if got != env:
            raise ValueError(f"{f} holds {got} samples but the run plays {env}; pass trajectories of this run's env")
        num_envs = num_envs or int((meta.get("recording") or {}).get("num_envs", 1))
        parts.append(arrays)
    out = {k: np.concatenate([p[k] for p in parts]) for k in ("obs", "next_obs", "reward", "done")}
    out["num_envs"] = num_envs
    return out


def check_trajectory_files(directory: Path) -> None:
    """Before any play: `directory` holds .npz files that read back whole (every member's CRC checked); ValueError
    (one line, naming the file) otherwise."""
    import zipfile

    files = sorted(Path(directory).glob("*.npz"))
    if not files:
        raise ValueError(f"--trajectories {directory} holds no trajectory files (*.npz); record some with "
                         f"`python -m rl.eval RUN_DIR --save-trajectories {directory}`")
    for f in files:
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip()
        except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
            raise ValueError(f"{f}: unreadable as .npz ({type(e).__name__}: {e}); record it again or remove "
                             f"it") from None
        if bad is not None:
            raise ValueError(f"{f}: unreadable as .npz (member {bad!r} is damaged: bad CRC); record it again or "
                             f"remove it")


def returns_to_go(reward: np.ndarray, done: np.ndarray, num_envs: int, gamma: float):
    """(rtg [N], valid bool [N]) of a time-major sample stream (sample i = step i // num_envs of env
    i % num_envs): the discounted return from each sample to its episode's end; samples of an episode that does
    not end in the stream are not valid (their return is unknown). `rl.returns.stream_returns`."""
    return stream_returns(reward, done, num_envs, gamma)


def value_diagnostics(value, next_value, reward, done, rtg, valid, gamma: float, bins: int = 10) -> dict[str, Any]:
    """Pearson / Spearman of V against the return-to-go, explained variance 1 - Var(rtg - V) / Var(rtg), a
    `bins`-bin calibration (samples sorted by V, equal counts: mean V and mean return per bin) over the valid
    samples; one-step TD error r + gamma V(s') (1 - done) - V(s) on all samples, split by terminal or not."""
    value, next_value = np.asarray(value, np.float64), np.asarray(next_value, np.float64)
    v, g = value[valid], rtg[valid]
    out: dict[str, Any] = {"samples": int(len(value)), "valid": int(valid.sum())}
    if len(v) > 1 and v.std() > 0 and g.std() > 0:
        out["pearson"] = float(np.corrcoef(v, g)[0, 1])
        out["spearman"] = float(np.corrcoef(rankdata(v), rankdata(g))[0, 1])
        out["explained_variance"] = float(1.0 - np.var(g - v) / np.var(g))
    else:
        out.update(pearson=None, spearman=None, explained_variance=None)
    if len(v) >= bins:
        chunks = np.array_split(np.argsort(v, kind="stable"), bins)
        out["calibration"] = [{"mean_value": float(v[c].mean()), "mean_return": float(g[c].mean()), "n": len(c)}
                              for c in chunks]
    td = np.asarray(reward, np.float64) + gamma * next_value * (1.0 - np.asarray(done)) - value
    for name, sel in (("terminal", np.asarray(done, bool)), ("non_terminal", ~np.asarray(done, bool))):
        out[f"td_{name}"] = ({"n": int(sel.sum()), "mean": float(td[sel].mean()),
                              "mean_abs": float(np.abs(td[sel]).mean())} if sel.any() else {"n": 0})
    return out

"""Discounted returns-to-go: the one definition (offline training's targets, the probe's value diagnostics).

Both work on time-major [T, B] arrays of one stream (B envs stepped together, T steps), as `rl.trajectories`
records them (sample i of a stream = step i // B of env i % B). `valid` marks the positions that hold a sample:
padding at a stream's ragged start or end, and a gap (a missing file), are invalid; nothing reaches across them.
"""
from __future__ import annotations

import numpy as np


def returns_to_go(reward, done, gamma: float, valid=None, dtype=np.float32) -> np.ndarray:
    """Discounted return-to-go `dtype` [T, B] of rewards [T, B]: G_t = r_t + gamma * G_{t+1} * (1 - done_t).

    `done` [T, B] ends a return (the step that ended an episode keeps its own reward, nothing after it). An
    invalid position (`valid` False) is a hole in the stream: it contributes nothing and cuts the return before
    it (that return is truncated). After the last step the return is truncated as well."""
    reward = np.asarray(reward, dtype)
    done = np.asarray(done, bool)
    if reward.shape != done.shape or reward.ndim != 2:
        raise ValueError(f"reward and done must both be [T, B]; got {reward.shape} and {done.shape}")
    if valid is not None:
        valid = np.asarray(valid, bool)
        reward = np.where(valid, reward, dtype(0))
        done = done | ~valid
    keep = dtype(gamma) * (~done).astype(dtype)
    out = np.empty_like(reward)
    carry = np.zeros(reward.shape[1], dtype)
    for t in range(reward.shape[0] - 1, -1, -1):
        carry = reward[t] + keep[t] * carry
        out[t] = carry
    return out


def truncated_mask(done, valid=None) -> np.ndarray:
    """bool [T, B]: valid positions whose return is cut short, i.e. no episode end follows them in their env's
    stream before a hole or the stream's end."""
    done = np.asarray(done, bool)
    valid = np.ones_like(done) if valid is None else np.asarray(valid, bool)
    out = np.zeros_like(done)
    ended = np.zeros(done.shape[1], bool)  # an episode end lies ahead (before any hole)
    for t in range(done.shape[0] - 1, -1, -1):
        ended = np.where(valid[t], ended | done[t], False)
        out[t] = valid[t] & ~ended
    return out


def stream_returns(reward, done, num_envs: int, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """(rtg float64 [N], known bool [N]) of a flat time-major sample stream (sample i = step i // num_envs of env
    i % num_envs): `returns_to_go` in float64, and whether each return is known (an episode end follows it in its
    env's stream; `truncated_mask`)."""
    n = len(reward)
    steps = -(-n // num_envs)
    valid = (np.arange(steps * num_envs) < n).reshape(steps, num_envs)
    pad = lambda x, dt: np.concatenate([np.asarray(x, dt), np.zeros(steps * num_envs - n, dt)]).reshape(steps, num_envs)
    r, d = pad(reward, np.float64), pad(done, bool)
    rtg = returns_to_go(r, d, gamma, valid, dtype=np.float64)
    known = valid & ~truncated_mask(d, valid)
    return rtg.reshape(-1)[:n], known.reshape(-1)[:n]

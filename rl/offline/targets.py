"""Per-env-stream targets of offline training: Monte-Carlo returns-to-go and the hidden-skip schedule.

Both work on time-major [T, B] arrays of one stream (B envs stepped together, T steps), as `rl.trajectories`
records them (sample i of a stream = step i // B of env i % B). `valid` marks the positions that hold a sample:
padding at a stream's ragged start or end, and a gap (a missing file), are invalid; nothing reaches across them.
"""
from __future__ import annotations

import numpy as np


def returns_to_go(reward, done, gamma: float, valid=None) -> np.ndarray:
    """Discounted return-to-go float32 [T, B] of rewards [T, B]: G_t = r_t + gamma * G_{t+1} * (1 - done_t).

    `done` [T, B] ends a return (the step that ended an episode keeps its own reward, nothing after it). An
    invalid position (`valid` False) is a hole in the stream: it contributes nothing and cuts the return before
    it (that return is truncated). After the last step the return is truncated as well."""
    reward = np.asarray(reward, np.float32)
    done = np.asarray(done, bool)
    if reward.shape != done.shape or reward.ndim != 2:
        raise ValueError(f"reward and done must both be [T, B]; got {reward.shape} and {done.shape}")
    if valid is not None:
        valid = np.asarray(valid, bool)
        reward = np.where(valid, reward, np.float32(0))
        done = done | ~valid
    keep = np.float32(gamma) * (~done).astype(np.float32)
    out = np.empty_like(reward)
    carry = np.zeros(reward.shape[1], np.float32)
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


def hold_source(done, hidden_skip_n: int, valid=None) -> np.ndarray:
    """int64 [T, B]: the step whose hidden state position (t, b) reads when each env refreshes its hidden
    state every `hidden_skip_n` steps and whenever its stream (re)starts: its first step, the first step after
    an episode end (`done`) and the first step after a hole (`valid` False). A held state therefore never
    crosses an episode end or a gap. -1 at invalid positions."""
    if hidden_skip_n < 1:
        raise ValueError(f"hidden_skip_n must be >= 1, got {hidden_skip_n}")
    done = np.asarray(done, bool)
    valid = np.ones_like(done) if valid is None else np.asarray(valid, bool)
    T, B = done.shape
    out = np.full((T, B), -1, np.int64)
    source = np.zeros(B, np.int64)
    age = np.zeros(B, np.int64)
    restart = np.ones(B, bool)  # the next valid step starts a segment
    for t in range(T):
        refresh = valid[t] & (restart | (age >= hidden_skip_n))
        source = np.where(refresh, t, source)
        age = np.where(refresh, 1, age + 1)
        out[t] = np.where(valid[t], source, -1)
        restart = ~valid[t] | done[t]
    return out

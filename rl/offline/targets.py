"""Per-env-stream targets of offline training: Monte-Carlo returns-to-go and the hidden-skip schedule.

Both work on time-major [T, B] arrays of one stream (B envs stepped together, T steps), as `rl.trajectories`
records them (sample i of a stream = step i // B of env i % B). `valid` marks the positions that hold a sample:
padding at a stream's ragged start or end, and a gap (a missing file), are invalid; nothing reaches across them.
"""
from __future__ import annotations

import numpy as np

from rl.returns import returns_to_go, truncated_mask  # noqa: F401 - the one definition (rl.returns)


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

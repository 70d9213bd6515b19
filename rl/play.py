"""Playing episodes with a trained policy: the one host loop and episode bookkeeping of rl.eval, rl.video and
rl.offline eval.

Every env plays one episode from a fresh world and only that first episode counts (short episodes are not
over-counted). A tool supplies a jitted `run_window(carry, seen, length) -> (carry, seen[, extra])` that plays
`length` steps of all envs (its policy, its hidden-state source and rules) and folds the window's `StepInfo`
into `seen` with `first_episodes`; `play_windows` runs the windows until every env finished or `max_steps`.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Episodes(NamedTuple):
    """Each env's first episode: its return, length and achievements once `finished`."""

    finished: jax.Array  # bool [B]
    returns: jax.Array  # float32 [B]
    lengths: jax.Array  # int32 [B]
    achievements: jax.Array  # bool [B, A]


def no_episodes(n: int, num_achievements: int) -> Episodes:
    """Episodes of `n` envs before any finished."""
    return Episodes(jnp.zeros(n, bool), jnp.zeros(n), jnp.zeros(n, jnp.int32), jnp.zeros((n, num_achievements), bool))


def first_episodes(seen: Episodes, info) -> Episodes:
    """`seen` with the episodes that ended in a window's StepInfo [T, B] added, for envs that had none yet."""
    ended = info.episode_length > 0
    first = jnp.argmax(ended, axis=0)  # each env's first step that ended an episode
    at_first = lambda x: x[first, jnp.arange(x.shape[1])]
    new = ended.any(0) & ~seen.finished
    pick = lambda x, old: jnp.where(new.reshape(new.shape + (1,) * (old.ndim - 1)), at_first(x), old)
    return Episodes(seen.finished | new, pick(info.episode_return, seen.returns),
                    pick(info.episode_length, seen.lengths), pick(info.achievements, seen.achievements))


def play_windows(run_window: Callable, carry: Any, seen: Episodes, max_steps: int, window: int, *,
                 clip_last: bool = False, on_window: Callable | None = None,
                 on_progress: Callable | None = None) -> tuple[Any, Episodes]:
    """Run `run_window(carry, seen, length)` until every env finished an episode or `max_steps` steps were played.
    `length` is `window` (`clip_last`: the last window only up to `max_steps`). `on_window` gets every window's
    third output (e.g. the recorded rollout); `on_progress` (steps played, episodes finished) after each window."""
    steps = 0
    while steps < max_steps and not bool(seen.finished.all()):
        length = min(window, max_steps - steps) if clip_last else window
        out = run_window(carry, seen, length)
        carry, seen = out[:2]
        if on_window is not None:
            on_window(out[2])
        steps += length
        if on_progress is not None:
            on_progress(steps, int(seen.finished.sum()))
    return carry, seen


def episode_results(seen: Episodes, running) -> dict[str, Any]:
    """numpy results of a play: each env's first episode, or for an env still playing (`running`: the batched env
    state with `episode_return` and `episode_length`) its episode so far."""
    seen, running = jax.device_get((seen, running))
    return dict(returns=np.where(seen.finished, seen.returns, running.episode_return),
                lengths=np.where(seen.finished, seen.lengths, running.episode_length),
                achievements=seen.achievements, unfinished=int((~seen.finished).sum()))


def summarise(result: dict, names) -> dict[str, Any]:
    """The eval.json entry of one mode's results (means; the per-episode values are kept for the verdict)."""
    r = result["returns"]
    return {"episodes": len(r), "return_mean": float(r.mean()),
            "return_stderr": float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0,
            "length_mean": float(result["lengths"].mean()), "unfinished": result["unfinished"],
            "achievements": {n: float(x) for n, x in zip(names, result["achievements"].mean(0))},
            # per episode, in env order (env i plays the same world in every mode): the paired verdict's data
            "episode_returns": [float(x) for x in r],
            "episode_achievements": np.asarray(result["achievements"], np.int8).tolist()}

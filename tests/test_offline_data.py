"""rl.offline's data side against plain python loops: returns-to-go across file boundaries, the hidden-skip
schedule at episode ends and stream gaps, the compact observation layout, and bad files named in one line."""
import json

import numpy as np
import pytest

from rl.offline import returns_to_go
from rl.offline import data as D
from rl.trajectories import TrajectoryError, meta_array

ENV = "Craftax-Classic-Symbolic-v1"
O = 1345


def _loop_rtg(reward, done, gamma):
    """Plain per-env python loop: G_t = r_t + gamma * G_{t+1} unless done_t; truncated at the end."""
    T, B = reward.shape
    out = np.zeros((T, B))
    for b in range(B):
        g = 0.0
        for t in reversed(range(T)):
            g = reward[t, b] + (0.0 if done[t, b] else gamma * g)
            out[t, b] = g
    return out


def _stream(T, B, seed=0):
    rng = np.random.default_rng(seed)
    reward = rng.normal(size=(T, B)).astype(np.float32)
    done = rng.random((T, B)) < 0.08
    obs = (rng.random((T * B, O)) < 0.05).astype(np.float32)
    obs[:, -3:] = rng.integers(0, 10, (T * B, 3)) / 10.0  # non-binary columns (like inventory counts)
    return reward, done, obs


def _write(path, obs, action, reward, done, first, B, hidden=None, recording=True, **extra):
    arrays = {"obs": obs, "next_obs": obs, "action": action, "reward": reward, "done": done,
              "log_prob": np.zeros(len(obs), np.float32), **extra}
    if hidden is not None:
        arrays["hidden_state"] = hidden
    if recording:
        arrays["recording"] = meta_array({"env": ENV, "num_envs": B, "first_sample": first, "samples": len(obs),
                                          "source": "rl.train", "run_dir": "x"})
    np.savez(path, **arrays)


def _split_files(tmp_path, reward, done, obs, cuts, hidden=None, skip=()):
    """Write the flattened time-major stream as files cut at sample indices `cuts` (file k in `skip` left out)."""
    T, B = reward.shape
    flat = lambda a: a.reshape((T * B,) + a.shape[2:])
    r, d = flat(reward), flat(done)
    action = np.arange(T * B, dtype=np.int32) % 17
    bounds = [0, *cuts, T * B]
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if k in skip:
            continue
        _write(tmp_path / f"traj-{a:012d}.npz", obs[a:b], action[a:b], r[a:b], d[a:b], a, B,
               None if hidden is None else hidden[a:b])
    return bounds


def test_returns_to_go_matches_loop():
    reward, done, _ = _stream(50, 6)
    got = returns_to_go(reward, done, 0.99)
    assert got.dtype == np.float32 and got.shape == (50, 6)
    np.testing.assert_allclose(got, _loop_rtg(reward, done, 0.99), rtol=1e-5, atol=1e-5)


def test_plan_rtg_exact_across_file_boundaries(tmp_path):
    T, B = 40, 8
    reward, done, obs = _stream(T, B, seed=1)
    _split_files(tmp_path, reward, done, obs, cuts=[100, 203])  # boundaries inside a time step
    files = D.scan(tmp_path)
    pl = D.plan(files, 0.99, 1)
    assert pl.streams == 1 and pl.gaps == 0 and pl.rows == T * B
    want = _loop_rtg(reward, done, 0.99).reshape(-1)  # one loop over the whole stream
    np.testing.assert_allclose(pl.rtg, want, rtol=1e-5, atol=1e-5)
    # truncated = samples with no episode end after them in their env's column
    trunc = sum(int(np.argmax(done[::-1, b])) if done[:, b].any() else T for b in range(B))
    assert pl.truncated == trunc


def test_reference_return_to_go_used_and_files_without_recording(tmp_path):
    rng = np.random.default_rng(2)
    n = 64 * 4
    own = rng.normal(size=n).astype(np.float32)
    obs = np.zeros((n, O), np.float32)
    _write(tmp_path / "ref_0.npz", obs, np.zeros(n, np.int64), np.ones(n, np.float32), np.zeros(n, bool), 0, 4,
           recording=False, return_to_go=own)
    pl = D.plan(D.scan(tmp_path, file_envs=4), 0.99, 1)
    np.testing.assert_array_equal(pl.rtg, own)
    assert pl.truncated == 0


def test_held_hidden_never_crosses_episode_end_or_gap(tmp_path):
    T, B, n = 60, 5, 4
    reward, done, obs = _stream(T, B, seed=3)
    bounds = _split_files(tmp_path, reward, done, obs, cuts=[77, 150, 231], skip={2})  # samples 150..230 missing
    files = D.scan(tmp_path)
    pl = D.plan(files, 0.99, n)
    assert pl.gaps == 1
    # global stream index of every row (files in order, the missing one left out)
    g = np.concatenate([np.arange(a, b) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if k != 2])
    src_g = g[pl.source]
    t, b = g // B, g % B
    ts, bs = src_g // B, src_g % B
    assert (bs == b).all(), "a held state comes from another env"
    assert ((t - ts >= 0) & (t - ts < n)).all(), "a held state older than hidden_skip_n steps"
    present = np.zeros(T * B, bool)
    present[g] = True
    flat_done = done.reshape(-1)
    for i in range(len(g)):
        between = np.arange(ts[i], t[i]) * B + b[i]  # the steps from the source up to (not incl.) this one
        assert present[between].all(), f"row {i} reads a state from across a gap"
        assert not flat_done[between].any(), f"row {i} reads a state from a finished episode"
    # refreshes: the first step of each episode reads its own state
    starts = np.concatenate([[True] * B, flat_done[:-B]])[g]
    assert (pl.source[starts] == np.flatnonzero(starts)).all()


def test_layout_round_trip_exact():
    import jax.numpy as jnp

    _, _, obs = _stream(10, 4, seed=4)
    obs[:, 5] = 0.3  # not float16-exact: the rest goes float32
    scan = D.LayoutScan(O)
    scan.add(obs)
    lay = scan.layout()
    assert lay.rest_dtype == "float32" and len(lay.binary) == O - 4
    bits, rest = lay.encode(obs)
    back = np.asarray(D.decode_obs(jnp.asarray(bits), jnp.asarray(rest), lay))
    np.testing.assert_array_equal(back, obs)
    assert lay.bytes_per_sample < obs[0].nbytes / 15


@pytest.mark.parametrize("case, expect", [
    ("no_reward", "missing key 'reward'"),
    ("bad_action", "key 'action' is float32 [40]"),
    ("short_done", "key 'done' is bool [39]"),
    ("bad_hidden", "key 'hidden_state' is float16 [40]"),
    ("not_npz", "unreadable as .npz"),
])
def test_bad_files_named_in_one_line(tmp_path, case, expect):
    n = 40
    arrays = {"obs": np.zeros((n, O), np.float32), "action": np.zeros(n, np.int32),
              "reward": np.zeros(n, np.float32), "done": np.zeros(n, bool)}
    if case == "no_reward":
        del arrays["reward"]
    elif case == "bad_action":
        arrays["action"] = np.zeros(n, np.float32)
    elif case == "short_done":
        arrays["done"] = np.zeros(n - 1, bool)
    elif case == "bad_hidden":
        arrays["hidden_state"] = np.zeros(n, np.float16)
    path = tmp_path / "bad.npz"
    if case == "not_npz":
        path.write_text("hello")
    else:
        np.savez(path, **arrays)
    with pytest.raises(TrajectoryError) as e:
        D.scan(tmp_path)
    msg = str(e.value)
    assert str(path) in msg and expect in msg and "\n" not in msg


def test_missing_hidden_named(tmp_path):
    reward, done, obs = _stream(4, 2)
    _split_files(tmp_path, reward, done, obs, cuts=[])
    with pytest.raises(TrajectoryError, match="missing key 'hidden_state'.*rl.label"):
        D.scan(tmp_path, need_hidden=True)


def test_split_files_spread():
    files = [None] * 20
    train, val = D.split_files(files, 0.1)
    assert len(val) == 2 and not set(train) & set(val) and sorted(train + val) == list(range(20))
    assert D.split_files(files[:1], 0.5) == ([0], [])
    assert json.dumps(val)


def test_cli_names_a_bad_file_in_one_line(tmp_path, capsys):
    from rl.offline.__main__ import main

    reward, done, obs = _stream(4, 2)
    _split_files(tmp_path, reward, done, obs, cuts=[4])
    with np.load(tmp_path / "traj-000000000004.npz") as npz:
        arrays = {k: npz[k] for k in npz.files if k != "action"}
    np.savez(tmp_path / "traj-000000000004.npz", **arrays)
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--hidden", "none"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "traj-000000000004.npz" in err and "missing key 'action'" in err
    assert not (tmp_path / "run").exists()

"""rl.verdict: means with 95% intervals, paired bootstrap differences from `real`, the verdict (known cases)."""
import numpy as np
import pytest

from rl.verdict import NO_EVIDENCE, RELIES, add_verdicts, mean_interval, paired_difference, verdict


def _entry(returns, ach):
    returns, ach = np.asarray(returns, float), np.asarray(ach, int)
    return {"episodes": len(returns), "return_mean": float(returns.mean()), "return_stderr": 0.0, "length_mean": 1.0,
            "unfinished": 0, "achievements": {f"a{i}": float(x) for i, x in enumerate(ach.mean(0))},
            "episode_returns": returns.tolist(), "episode_achievements": ach.tolist()}


def test_a_constant_has_a_zero_width_interval():
    assert mean_interval([3.0] * 10) == (3.0, 3.0, 3.0)
    assert paired_difference([1.0, 2.0, 5.0], [1.0, 2.0, 5.0]) == (0.0, 0.0, 0.0)
    d, lo, hi = paired_difference([1.0, 2.0, 5.0], [0.0, 1.0, 4.0])  # every episode exactly 1 lower
    assert (d, lo, hi) == (-1.0, -1.0, -1.0) and verdict(hi) == RELIES


def test_pairing_removes_the_worlds_variance():
    """Worlds of very different returns, the mode 0.5 lower on each: unpaired intervals overlap, the paired
    difference is exactly -0.5."""
    rng = np.random.default_rng(1)
    worlds = rng.normal(0, 10, 64)
    _, lo_r, hi_r = mean_interval(worlds)
    _, lo_m, hi_m = mean_interval(worlds - 0.5)
    assert lo_m < hi_r and lo_r < hi_m  # the two means' intervals overlap
    d, lo, hi = paired_difference(worlds, worlds - 0.5)
    assert np.isclose(d, -0.5) and np.isclose(lo, -0.5) and np.isclose(hi, -0.5) and verdict(hi) == RELIES


def test_the_interval_covers_the_mean_at_about_95_percent():
    rng = np.random.default_rng(2)
    covered = sum(lo <= 1.0 <= hi for lo, hi in
                  (mean_interval(rng.normal(1.0, 1.0, 50), boots=500, seed=s)[1:] for s in range(200)))
    assert 0.88 <= covered / 200 <= 0.99


def test_noise_alone_gives_no_evidence():
    rng = np.random.default_rng(3)
    real = rng.normal(5, 2, 40)
    other = real + rng.normal(0, 1, 40)  # no shift
    d, lo, hi = paired_difference(real, other)
    assert lo < 0 < hi and verdict(hi) == NO_EVIDENCE


def test_deterministic_and_shape_checked():
    a = np.arange(20.0)
    assert paired_difference(a, a[::-1]) == paired_difference(a, a[::-1])
    with pytest.raises(ValueError, match="one shape"):
        paired_difference(a, a[:5])


def test_add_verdicts_for_returns_and_achievements():
    real = _entry([4.0, 6.0, 8.0, 10.0], [[1, 1], [1, 0], [1, 1], [1, 0]])
    zero = _entry([1.0, 3.0, 5.0, 7.0], [[0, 1], [0, 0], [0, 1], [0, 0]])  # 3 lower each; a0 always lost
    same = _entry([4.0, 6.0, 8.0, 10.0], [[1, 1], [1, 0], [1, 1], [1, 0]])
    out = add_verdicts({"real": real, "zero": zero, "variant": same})
    assert out["real"]["return_ci95"][0] <= 7.0 <= out["real"]["return_ci95"][1] and "vs_real" not in out["real"]
    vs = out["zero"]["vs_real"]
    assert vs["return_diff"] == -3.0 and vs["return_diff_ci95"] == [-3.0, -3.0] and vs["return_verdict"] == RELIES
    assert vs["achievement_rate_diff"] == -0.5 and vs["achievement_rate_verdict"] == RELIES
    assert vs["achievements"]["a0"] == {"diff": -1.0, "ci95": [-1.0, -1.0], "verdict": RELIES}
    assert vs["achievements"]["a1"]["verdict"] == NO_EVIDENCE and "95%" in vs["threshold"]
    assert out["variant"]["vs_real"]["return_verdict"] == NO_EVIDENCE
    old = {"real": {k: v for k, v in real.items() if not k.startswith("episode_")}}  # an older eval.json entry
    assert add_verdicts(old) == old


def test_the_table_states_intervals_verdicts_and_the_threshold(tmp_path):
    from rl.eval_report import format_table, plot_ablations

    results = {"real": _entry([4.0, 6.0, 8.0, 10.0], [[1, 1]] * 4), "zero": _entry([1.0, 3.0, 5.0, 7.0], [[0, 1]] * 4)}
    text = format_table(results)
    assert "95% interval" in text and RELIES in text and "-3.00 [-3.00, -3.00]" in text
    assert "lies entirely below 0" in text and "achievement rate -50.0%" in text
    assert plot_ablations(results, tmp_path / "bars.png", "run").stat().st_size > 1000

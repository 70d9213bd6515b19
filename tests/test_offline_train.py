"""rl.offline end to end on the CPU with the tiny model: record (rl.train --preset test --save-trajectories) ->
rl.label -> rl.offline train a few hundred updates -> rl.offline eval 2 episodes; the normalisation statistics
come back with the checkpoint; a run stopped at a checkpoint and resumed equals an uninterrupted one bit for bit
(streamed shards, so the prefetching reader and its schedule are covered too)."""
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from rl.offline import data as D
from rl.offline import load_policy
from rl.offline.__main__ import main
from rl.offline.config import OfflineConfig
from rl.offline.train import resume_config, train

SMALL = ["--width", "32", "--batch-size", "32", "--updates-per-dispatch", "50", "--log-every", "100",
         "--checkpoint-every", "100", "--val-fraction", "0.2"]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    """192 samples of the test preset (8 envs x 8 steps x 3 updates), 40 per file, labelled by the tiny model."""
    from rl.label import LabelConfig, label_files
    from rl.train import main as train_main

    root = tmp_path_factory.mktemp("offline")
    rec = root / "recorded"
    assert train_main(["--preset", "test", "--run-dir", str(root / "ppo"), "--save-trajectories", str(rec),
                       "--samples-per-file", "40", "--quiet"]) == 0
    out = root / "labelled"
    summary = label_files(sorted(rec.glob("*.npz")), out, LabelConfig(model="tiny", llm_dtype="float32", batch=64),
                          quiet=True)
    assert summary.files == 5 and not summary.bad
    return out


@pytest.fixture(scope="module")
def run(labelled, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("awr") / "run"
    assert main(["train", "--data", str(labelled), "--out", str(out), "--hidden", "real", "--hidden-skip-n", "2",
                 "--steps", "300", "--quiet", *SMALL]) == 0
    return out


def test_train_then_eval_end_to_end(run, capsys):
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["kind"] == "offline-awr" and cfg["hidden_skip_n"] == 2 and cfg["labelling"]["model"] == "tiny"
    assert cfg["data"]["samples"] == 192 and cfg["data"]["val_files"] == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records] == [100, 200, 300]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["val_nll"]) for r in records)
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2", "--max-steps", "48"]) == 0
    results = json.loads((run / "eval.json").read_text())
    assert list(results) == ["real", "zeros", "shuffled"]
    assert all(r["episodes"] == 2 and set(r) >= {"return_mean", "length_mean", "achievements"}
               for r in results.values())
    assert {(r["checkpoint"], r["seed"], r["max_steps"]) for r in results.values()} == {(300, 1234, 48)}
    assert results["real"]["system_prompt"].startswith("You")  # the prompt the labels were read behind
    assert (run / "eval_ablations.png").exists()
    out, err = capsys.readouterr()
    assert "hidden state" in out
    # issue 37 item 10: a status line while each mode plays, and the legend says what `zeros` is here
    assert all(f"  {m}: " in err and "steps played (at most 48)" in err for m in results), err
    assert "the dataset's mean hidden state" in out and "all-zero" not in out


def test_statistics_restored_with_the_checkpoint(run, labelled):
    pol = load_policy(run)
    assert pol.uses_hidden and pol.hidden_skip_n == 2 and pol.step == 300 and pol.env.startswith("Craftax-Classic")
    files = D.scan(labelled, need_hidden=True)
    train_idx, _ = D.split_files(files, 0.2)
    h = np.concatenate([D.load_hidden(files[i].path).astype(np.float64) for i in train_idx])
    np.testing.assert_allclose(np.asarray(pol.stats["mean"]), h.mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pol.stats["std"]), np.maximum(h.std(0), 1e-6), rtol=1e-3, atol=1e-5)
    obs = np.zeros((3, 1345), np.float32)
    dist, value = pol.apply(pol.params, obs, h[:3].astype(np.float32))
    assert dist.logits.shape == (3, 17) and value.shape == (3,)


def test_resume_equals_uninterrupted_bitwise(labelled, tmp_path):
    base = OfflineConfig(data=str(labelled), hidden="shuffle", hidden_skip_n=3, steps=200, width=32, batch_size=32,
                         updates_per_dispatch=50, log_every=100, checkpoint_every=100, val_fraction=0.2,
                         resident="off", shard_samples=60)
    full = train(dataclasses.replace(base, out=str(tmp_path / "full")), quiet=True)
    part = train(dataclasses.replace(base, out=str(tmp_path / "part")), stop_after=100, quiet=True)
    assert load_policy(part).step == 100
    train(resume_config(part, {}), resume=True, quiet=True)
    a, b = load_policy(full), load_policy(part)
    assert b.step == 200
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params, b.params)
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if k != "updates_per_s"}
                       for line in (p / "metrics.jsonl").read_text().splitlines()]
    assert strip(full) == strip(part)


def test_resume_refuses_changed_settings(run):
    assert main(["train", "--resume", str(run), "--beta", "3"]) == 1

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
    assert list(results) == ["real", "zero", "shuffled"]
    assert all(r["episodes"] == 2 and set(r) >= {"return_mean", "length_mean", "achievements"}
               for r in results.values())
    assert {(r["checkpoint"], r["seed"], r["max_steps"]) for r in results.values()} == {(300, 1234, 48)}
    assert results["real"]["system_prompt"].startswith("You")  # the prompt the labels were read behind
    assert (run / "eval_ablations.png").exists()
    out, err = capsys.readouterr()
    assert "hidden state" in out
    # issue 37 item 10: a status line while each mode plays, and the legend says what `zero` is here
    assert all(f"  {m}: " in err and "steps played (at most 48)" in err for m in results), err
    assert "the dataset's mean hidden state" in out and "all-zero" not in out


def test_eval_prompt_variants_and_other_prompt(run, tmp_path, capsys):
    """`rl.offline eval --prompt/--prompts` (issue 36) and the table's other modes: a variant repeating the labels'
    own system prompt plays exactly `real`; a missing --prompts file is one line and writes nothing."""
    from render.chat import default_system_prompt

    before = (run / "eval.json").read_bytes() if (run / "eval.json").exists() else None
    assert main(["eval", str(run), "--episodes", "2", "--max-steps", "16", "--prompts", str(tmp_path / "no.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompts" in err[0] and "no such file" in err[0]
    assert ((run / "eval.json").read_bytes() if (run / "eval.json").exists() else None) == before
    spec = tmp_path / "v.json"
    spec.write_text(json.dumps({"garbage": {"random_tokens": True}, "nothing": {"empty": True}}))
    same = default_system_prompt("Craftax-Classic-Symbolic-v1", "compact")
    assert main(["eval", str(run), "--episodes", "2", "--max-steps", "16", "--modes", "real", "other_prompt",
                 "--prompt", f"same={same}", "--prompts", str(spec)]) == 0
    results = json.loads((run / "eval.json").read_text())
    assert list(results) == ["real", "other_prompt", "same", "garbage", "nothing"]
    assert results["same"]["episode_returns"] == results["real"]["episode_returns"]
    assert results["garbage"]["variant"]["kind"] == "random" and results["same"]["variant"]["system_prompt"] == same
    assert "vs_real" in results["nothing"] and "return_ci95" in results["real"]


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


def test_hidden_layer_chooses_one_of_several_labelled_layers(labelled, tmp_path, capsys):
    """`rl.offline train --hidden-layer K` on files labelled with `--llm-layer -1,0`: the statistics are those of
    `hidden_state_L0`, the run's labelling names layer 0 (what eval and the probe rebuild); a layer the files do not
    hold is one line naming the layers they do, nothing written."""
    from rl.label import LabelConfig, label_files

    multi = tmp_path / "multi"
    cfg = LabelConfig(model="tiny", llm_dtype="float32", batch=64, llm_layer=-1, more_layers=(0,))
    assert label_files(sorted((labelled.parent / "recorded").glob("*.npz")), multi, cfg, quiet=True).files == 5
    bad = tmp_path / "bad"
    assert main(["train", "--data", str(multi), "--out", str(bad), "--hidden-layer", "1", "--steps", "100",
                 "--quiet", *SMALL]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hidden-layer 1: the files hold no such layer (they hold 2, 0)" in err[0]
    assert not bad.exists()
    out = tmp_path / "awr0"
    assert main(["train", "--data", str(multi), "--out", str(out), "--hidden-layer", "0", "--steps", "100",
                 "--quiet", *SMALL]) == 0
    run_cfg = json.loads((out / "config.json").read_text())
    assert run_cfg["labelling"]["llm_layer"] == 0 and run_cfg["labelling"]["llm_layers"] == [2, 0]
    files = D.scan(multi, need_hidden=True, hidden_layer=0)
    assert {f.hidden_key for f in files} == {"hidden_state_L0"}
    train_idx, _ = D.split_files(files, 0.2)
    h = np.concatenate([D.load_hidden(files[i].path, "hidden_state_L0").astype(np.float64) for i in train_idx])
    np.testing.assert_allclose(np.asarray(load_policy(out).stats["mean"]), h.mean(0), rtol=1e-4, atol=1e-5)


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


# ------------------------------------------------------------------------------------------ issue 37

NONE = ["--hidden", "none", "--quiet", *SMALL]


def test_resume_from_any_directory_and_with_the_dataset_moved(labelled, tmp_path, monkeypatch, capsys):
    """Item 1: a run trained with a relative --data could not be resumed from another directory, and --data was
    refused at --resume. The run records its data as an absolute path; --data may point it at a moved copy of the
    same files, and is refused for other files."""
    import shutil

    monkeypatch.chdir(labelled.parent)
    run = tmp_path / "run"
    assert main(["train", "--data", labelled.name, "--out", str(run), "--steps", "100", *NONE]) == 0
    assert json.loads((run / "config.json").read_text())["settings"]["data"] == str(labelled.resolve())
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(run), "--steps", "200", "--quiet"]) == 0  # from another directory
    moved = tmp_path / "moved"
    shutil.copytree(labelled, moved)
    assert main(["train", "--resume", "run", "--data", "moved", "--steps", "300", "--quiet"]) == 0
    assert json.loads((run / "config.json").read_text())["settings"]["data"] == str(moved)
    assert load_policy(run).step == 300
    sorted(moved.glob("*.npz"))[-1].unlink()
    capsys.readouterr()
    assert main(["train", "--resume", "run", "--data", "moved", "--steps", "400", "--quiet"]) == 1
    assert "differ from those the run trained on" in capsys.readouterr().err


def _corrupt_member(path: Path, member: str) -> None:
    """Overwrite 64 bytes in the middle of one member's data: the file stays a valid zip, only its CRC is wrong."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    mid = start + info.compress_size // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def test_damaged_file_is_one_line_naming_it_and_leaves_no_run(labelled, tmp_path, capsys):
    """Item 3: a file damaged inside a valid zip (bad CRC) ended in a 41-line traceback that did not name it."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(labelled, data)
    victim = sorted(data.glob("*.npz"))[2]
    _corrupt_member(victim, "obs.npy")
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--steps", "100", *NONE]) == 1
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("warning:")]
    assert len(err) == 1 and str(victim) in err[0] and "unreadable as .npz" in err[0] and "CRC" in err[0], err
    assert not out.exists()


def test_ctrl_c_stops_within_one_dispatch_says_what_remains_and_exits_130(labelled, tmp_path, monkeypatch, capsys):
    """Item 9: Ctrl-C exited 0 and ran 1,000 more updates after saying "stopping after the update in progress"."""
    import os
    import signal

    import rl.offline.train as T

    real = T.make_train_chunk

    def make(*a, **k):
        chunk, calls = real(*a, **k), []

        def dispatch(*a, **k):
            calls.append(1)
            if len(calls) == 3:  # Ctrl-C while the third dispatch (updates 101-150) is being sent
                os.kill(os.getpid(), signal.SIGINT)
            return chunk(*a, **k)

        return dispatch

    monkeypatch.setattr(T, "make_train_chunk", make)
    run = tmp_path / "run"
    args = ["train", "--data", str(labelled), "--out", str(run), "--steps", "400", "--hidden", "none", *SMALL]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "Ctrl-C: stopping after update 150, 100 updates from now (those dispatched or due), with a checkpoint; " \
           "250 of 400 updates will remain" in err, err
    assert "stopped at update 150/400" in err and "(250 updates remain)" in err and "Traceback" not in err
    assert load_policy(run).step == 150
    assert [json.loads(line)["update"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [100, 150]

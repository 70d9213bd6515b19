"""rl.label: labelling recorded trajectory files with the tiny model.

A dataset is recorded once per session (`rl.train --preset test --save-trajectories`), labelled once in-process
(the reference), and the tests check: a labeller killed mid-file (a real subprocess, SIGKILL) and rerun writes the
reference bit for bit; bad files among good ones are reported by name and reason with exit code 1, the good ones
still labelled; the vectors equal `rl.encoders.make_ids_encoder`'s on the obs template's ids and the HTTP server's
on the same prompts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.label import Labeller, LabelConfig, label_files, main, sample_count
from rl.trajectories import ARRAYS, HIDDEN_KEY, LABELLING_KEY, RECORDING_KEY

REPO = Path(__file__).resolve().parent.parent
ENV = "Craftax-Classic-Symbolic-v1"
BATCH = 8  # observations per chunk: several chunks per file, so a kill lands mid-file
CFG = LabelConfig(model="tiny", llm_dtype="float32", batch=BATCH)


def _env():
    cache = os.environ["JAX_TEST_CACHE_DIR"]  # set by tests/conftest.py
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """Trajectory files recorded by the trainer: the test preset (Classic, 8 envs x 8 steps x 3 updates = 192
    samples), 40 samples per file -> 5 files (the last one 32 samples)."""
    from rl.train import main as train_main

    root = tmp_path_factory.mktemp("label")
    out = root / "trajectories"
    rc = train_main(["--preset", "test", "--run-dir", str(root / "run"), "--save-trajectories", str(out),
                     "--samples-per-file", "40", "--quiet"])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def labeller():
    return Labeller(CFG)


@pytest.fixture(scope="session")
def reference(dataset, labeller, tmp_path_factory) -> Path:
    """The dataset labelled in one uninterrupted in-process run."""
    out = tmp_path_factory.mktemp("reference")
    summary = label_files(sorted(dataset.glob("*.npz")), out, CFG, quiet=True, labeller=labeller)
    assert summary.files == 5 and not summary.bad and summary.samples == 192
    return out


def _load(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def test_recorded_files_hold_the_format(dataset):
    files = sorted(dataset.glob("*.npz"))
    assert [f.name for f in files] == [f"traj-{i:012d}.npz" for i in (0, 40, 80, 120, 160)]
    data = [_load(f) for f in files]
    assert [d["obs"].shape[0] for d in data] == [40, 40, 40, 40, 32] == [sample_count(f) for f in files]
    for d in data:
        assert set(ARRAYS) <= set(d) and d["obs"].dtype == np.float32 and d["obs"].shape[1] == 1345
        assert d["action"].dtype == np.int32 and d["done"].dtype == bool
        assert np.all(d["log_prob"] <= 0) and np.isfinite(d["reward"]).all()
        rec = json.loads(str(d[RECORDING_KEY]))
        assert rec["env"] == ENV and rec["num_envs"] == 8 and rec["samples"] == d["obs"].shape[0]
        assert rec["source"] == "rl.train"
    obs = np.concatenate([d["obs"] for d in data])
    nxt = np.concatenate([d["next_obs"] for d in data])
    # time-major: next_obs of (step t, env e) is obs of (step t + 1, env e) inside an update
    per_update = obs.reshape(3, 8, 8, -1)
    np.testing.assert_array_equal(nxt.reshape(3, 8, 8, -1)[:, :-1], per_update[:, 1:])
    # ... and the last step's next_obs is the next rollout's first obs
    np.testing.assert_array_equal(nxt.reshape(3, 8, 8, -1)[:-1, -1], per_update[1:, 0])


def test_labelled_files_carry_the_inputs_hidden_states_and_settings(dataset, reference):
    for src in sorted(dataset.glob("*.npz")):
        a, b = _load(src), _load(reference / src.name)
        for key in ARRAYS + (RECORDING_KEY,):
            np.testing.assert_array_equal(a[key], b[key])
        h = b[HIDDEN_KEY]
        assert h.dtype == np.float16 and h.shape == (a["obs"].shape[0], 64) and np.isfinite(h).all()
        assert np.abs(h).sum(1).min() > 0
        settings = json.loads(str(b[LABELLING_KEY]))
        assert settings["model"] == "tiny" and settings["pooling"] == "last" and settings["obs_format"] == "compact"
        assert settings["env"] == ENV and len(settings["prompt_sha256"]) == 64
    assert not list(reference.glob(".*")), "no temporary or partial files left"


def test_kill_mid_file_and_rerun_equals_the_uninterrupted_run(dataset, reference, labeller, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rl.label", str(dataset), "--out", str(out), "--model", "tiny",
                             "--llm-dtype", "float32", "--batch", str(BATCH), "--quiet"], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    state = out / ".traj-000000000040.npz.partial.json"  # the second file: the first one is done by then
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            try:
                if json.loads(state.read_text())["rows_done"] >= BATCH:
                    break
            except (FileNotFoundError, ValueError, KeyError):
                pass
            time.sleep(0.02)
        assert proc.poll() is None, f"the labeller ended before it could be killed:\n{proc.stderr.read()[-3000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = json.loads(state.read_text())["rows_done"]
    assert 0 < done < 40 and not (out / "traj-000000000040.npz").exists(), "killed mid-file"
    assert (out / "traj-000000000000.npz").exists()
    summary = label_files(sorted(dataset.glob("*.npz")), out, CFG, quiet=True, labeller=labeller)
    assert summary.skipped == 1 and summary.files == 4 and summary.samples == 192 - 40 - done
    for ref in sorted(reference.glob("*.npz")):
        assert (out / ref.name).read_bytes() == ref.read_bytes(), ref.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    again = label_files(sorted(dataset.glob("*.npz")), out, CFG, quiet=True, labeller=labeller)
    assert again.skipped == 5 and again.files == 0


def test_bad_files_are_reported_and_the_rest_labelled(dataset, reference, tmp_path, capsys):
    mixed = tmp_path / "in"
    mixed.mkdir()
    good = sorted(dataset.glob("*.npz"))[:2]
    for f in good:
        (mixed / f.name).write_bytes(f.read_bytes())
    (mixed / "corrupt.npz").write_bytes(b"PK\x03\x04 not really a zip file")
    np.savez(mixed / "craftax_size.npz", obs=np.zeros((4, 8268), np.float32),
             **{RECORDING_KEY: np.array(json.dumps({"env": ENV}))})
    np.savez(mixed / "odd_size.npz", obs=np.zeros((4, 1000), np.float32))
    np.savez(mixed / "no_obs.npz", action=np.zeros(4, np.int32))
    out = tmp_path / "out"
    rc = main([str(mixed), "--out", str(out), "--model", "tiny", "--llm-dtype", "float32", "--batch", str(BATCH),
               "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "corrupt.npz: unreadable as .npz" in err
    assert "craftax_size.npz: its observations have 8268 floats, but Craftax-Classic-Symbolic-v1" in err
    assert "odd_size.npz: an observation of 1000 floats fits no env" in err
    assert "no_obs.npz: it has no 'obs' array" in err
    for f in good:
        assert (out / f.name).read_bytes() == (reference / f.name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in good)


def test_object_arrays_are_left_out_not_unpickled(dataset, labeller, tmp_path):
    """A file like the reference pipeline's, with a `text_generated` column saved as objects: labelled, that
    column left out (files are never unpickled), a plain string column copied."""
    src = tmp_path / "in" / "theirs.npz"
    src.parent.mkdir()
    obs = _load(sorted(dataset.glob("*.npz"))[0])["obs"][:BATCH]
    np.savez(src, obs=obs, text_generated=np.array([""] * BATCH, dtype=object), note=np.array(["x"] * BATCH))
    summary = label_files([src], tmp_path / "out", CFG, quiet=True, labeller=labeller)
    assert summary.files == 1 and not summary.bad
    out = _load(tmp_path / "out" / "theirs.npz")
    assert "text_generated" not in out and list(out["note"]) == ["x"] * BATCH
    assert out[HIDDEN_KEY].shape == (BATCH, 64)


def _ids_of(labeller, obs):
    tpl = labeller.template(ENV)
    return jax.jit(jax.vmap(tpl))(jnp.asarray(obs))


def test_vectors_equal_the_inscan_encoder_on_the_same_ids(dataset, reference, labeller):
    """The labeller's vectors are `rl.encoders.make_ids_encoder`'s (the trainer's LLM call) on the obs template's
    ids of the same chunk of observations."""
    from rl.llm import make_ids_encoder

    name = "traj-000000000160.npz"  # 32 samples: 4 full chunks
    obs, hidden = _load(dataset / name)["obs"], _load(reference / name)[HIDDEN_KEY]
    encode = jax.jit(make_ids_encoder(labeller.model.config, layer=-1, pooling="last", method=CFG.llm_encode,
                                      chunk=CFG.llm_chunk))
    cache = labeller._setup(ENV)[1]
    for start in range(0, 32, BATCH):
        ids, lengths = _ids_of(labeller, obs[start:start + BATCH])
        expected = np.asarray(encode(labeller.params, cache, ids, lengths))
        # the same function compiled apart (here, and inside the labeller's shard_map) may differ by float32
        # rounding, which can move a value across a float16 rounding boundary: one float16 ulp (2^-10) apart
        np.testing.assert_allclose(hidden[start:start + BATCH].astype(np.float32), expected, rtol=2.0 ** -10,
                                   atol=1e-6)


def test_vectors_equal_the_http_servers(dataset, reference, labeller, start_tiny_server):
    """The same prompts (prefix + the template's ids) sent to `jaxllm.http.server` as token ids give the labelled
    vectors (up to float16 rounding and the server's own batching)."""
    from jaxllm.http.client import VLLMClient

    name = "traj-000000000000.npz"
    obs, hidden = _load(dataset / name)["obs"][:12], _load(reference / name)[HIDDEN_KEY][:12]
    ids, lengths = map(np.asarray, _ids_of(labeller, obs))
    prefix = labeller.template(ENV).prefix_ids
    url, _ = start_tiny_server()
    client = VLLMClient(url, timeout=60)
    try:
        served = np.asarray(client.embed([prefix + ids[i, : lengths[i]].tolist() for i in range(len(obs))]))
    finally:
        client.close()
    np.testing.assert_allclose(hidden.astype(np.float32), served, rtol=2e-3, atol=2e-3)


def _stream(directory: Path) -> dict:
    """Every array of the trajectory files in `directory`, joined in file-name (= stream) order."""
    data = [_load(f) for f in sorted(directory.glob("*.npz"))]
    return {k: np.concatenate([d[k] for d in data]) for k in ARRAYS}


def test_a_resumed_run_records_each_sample_once(dataset, tmp_path):
    """Stop after 1 update, resume: the recorded stream equals the uninterrupted run's (no sample lost or twice)."""
    from rl.train import main as train_main

    out = tmp_path / "trajectories"
    common = ["--save-trajectories", str(out), "--samples-per-file", "40", "--quiet"]
    assert train_main(["--preset", "test", "--run-dir", str(tmp_path / "run"), "--max-updates", "1", *common]) == 0
    assert [f.name for f in sorted(out.glob("*.npz"))] == ["traj-000000000000.npz", "traj-000000000040.npz"]
    assert train_main(["--resume", str(tmp_path / "run"), "--quiet"]) == 0
    names = [f.name for f in sorted(out.glob("*.npz"))]
    assert names == [f"traj-{i:012d}.npz" for i in (0, 40, 64, 104, 144, 184)]
    got, want = _stream(out), _stream(dataset)
    for key in ARRAYS:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # a new run never records into a directory holding another stream
    assert train_main(["--preset", "test", "--run-dir", str(tmp_path / "other"), *common]) == 1
    assert not (tmp_path / "other").exists()


def test_eval_records_the_policy_play(dataset, tmp_path):
    from rl.eval import main as eval_main

    out = tmp_path / "eval_trajectories"
    run_dir = dataset.parent / "run"
    assert eval_main([str(run_dir), "--episodes", "4", "--max-steps", "16", "--save-trajectories", str(out),
                      "--samples-per-file", "40"]) == 0
    files = sorted(out.glob("*.npz"))
    data = [_load(f) for f in files]
    assert [d["obs"].shape[0] for d in data] == [40, 24]  # 4 envs x 16 steps
    rec = json.loads(str(data[0][RECORDING_KEY]))
    assert rec["source"] == "rl.eval" and rec["num_envs"] == 4 and rec["env"] == ENV
    stream = _stream(out)
    assert stream["obs"].shape == (64, 1345) and np.all(stream["log_prob"] <= 0)
    np.testing.assert_array_equal(stream["next_obs"].reshape(16, 4, -1)[:-1], stream["obs"].reshape(16, 4, -1)[1:])


def test_three_shards_as_three_processes_equal_one_unsharded_run(dataset, reference, tmp_path):
    """`--shard K/3` run as three processes at once into one --out: disjoint files, and their union is the
    uninterrupted unsharded run bit for bit."""
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "rl.label", str(dataset), "--out", str(out), "--model", "tiny",
                               "--llm-dtype", "float32", "--batch", str(BATCH), "--quiet", "--shard", f"{k}/3"],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in (1, 2, 3)]
    lines = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-3000:]
        lines.append(stdout)
    assert [int(line.split("labelled ")[1].split(" files")[0]) for line in lines] == [2, 2, 1]  # 5 files over 3
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for ref in sorted(reference.glob("*.npz")):
        assert (out / ref.name).read_bytes() == ref.read_bytes(), ref.name


def test_shard_files_split_the_files_once():
    from rl.label import parse_shard, shard_files

    files = [Path(f"d/f{i}.npz") for i in (3, 0, 4, 1, 2)]
    parts = [shard_files(files, (k, 3)) for k in (1, 2, 3)]
    assert [[p.name for p in part] for part in parts] == [["f0.npz", "f3.npz"], ["f1.npz", "f4.npz"], ["f2.npz"]]
    assert shard_files(files, None) == sorted(files)
    assert parse_shard("2/3") == (2, 3) and parse_shard(None) is None
    for bad in ("0/3", "4/3", "a/b", "3", "1/0", "-1/3"):
        with pytest.raises(ValueError, match=r"--shard .*K/N .*1 <= K <= N"):
            parse_shard(bad)


@pytest.mark.parametrize("shard", ["0/3", "4/3", "a/b"])
def test_a_malformed_shard_is_one_line_and_writes_nothing(dataset, tmp_path, capsys, shard):
    out = tmp_path / "out"
    rc = main([str(dataset), "--out", str(out), "--model", "tiny", "--quiet", "--shard", shard])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: --shard {shard}:") and "--shard 1/3" in err[0]
    assert not out.exists()


def test_several_layers_from_one_pass_equal_single_layer_runs(dataset, reference, tmp_path):
    """`--llm-layer 1,0,-1`: `hidden_state` is layer 1 (today's readers), `hidden_state_L0` / `_L2` the others
    (tiny has 2 layers: -1 is index 2), each equal to a single-layer labelling of that layer, bit for bit; the
    metadata names the layers."""
    from dataclasses import replace

    from rl.layers import hidden_key_of

    files = sorted(dataset.glob("*.npz"))[3:]  # 40 + 32 samples
    multi = label_files(files, tmp_path / "multi", replace(CFG, llm_layer=1, more_layers=(0, -1)), quiet=True)
    assert multi.files == 2 and not multi.bad
    singles = {}
    for layer in (1, 0, -1):
        out = tmp_path / f"single{layer}"
        assert label_files(files, out, replace(CFG, llm_layer=layer), quiet=True).files == 2
        singles[layer] = out
    for f in files:
        got = _load(tmp_path / "multi" / f.name)
        lab = json.loads(str(got[LABELLING_KEY]))
        assert lab["llm_layers"] == [1, 0, 2] and lab["model_layers"] == 2 and lab["llm_layer"] == 1
        for layer, key in ((1, "hidden_state"), (0, "hidden_state_L0"), (-1, "hidden_state_L2")):
            assert hidden_key_of(lab, layer) == key
            np.testing.assert_array_equal(got[key], _load(singles[layer] / f.name)[HIDDEN_KEY], err_msg=key)
        with pytest.raises(ValueError, match=r"--hidden-layer 5: the files hold no such layer \(they hold 1, 0, 2\)"):
            hidden_key_of(lab, 5)


@pytest.mark.parametrize("layers,message", [("5", "index 5 is past the model's depth (2 layers: indices -3..2"),
                                            ("1,x", "give one index or several separated by commas"),
                                            ("2,-1", "a layer is given twice")])
def test_bad_layers_are_one_line_and_write_nothing(dataset, tmp_path, capsys, layers, message):
    out = tmp_path / "out"
    rc = main([str(dataset), "--out", str(out), "--model", "tiny", "--quiet", "--llm-layer", layers])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and not out.exists()

"""Qwen3-MoE wherever the dense model runs, on the CPU with the `tiny-moe` preset (8 experts, 2 per token, the real
vocabulary): the in-scan trainer (its vectors equal the encoder called outside the scan), recording and labelling,
evaluation with ablations, the HTTP server (the same vectors as the labeller) and the trainer reading it
(`--encoder vllm`), the probe of the in-scan run, and offline AWR on the labelled recording with its evaluation
re-encoding the prompts."""
import json

import jax
import numpy as np
import pytest

from rl.config import PRESETS, TrainConfig

ENV = "Craftax-Classic-Symbolic-v1"


def test_inscan_vectors_equal_the_encoder_outside_the_scan():
    from rl.llm import load_llm
    from rl.trainer import RolloutCarry, Trainer

    cfg = TrainConfig(**dict(PRESETS["test"], env=ENV, encoder="inscan", num_envs=4, num_steps=4, skip_n=4,
                             model="tiny-moe"))
    llm = load_llm(cfg)
    assert llm.model.config.is_moe
    trainer = Trainer.from_config(cfg, llm)
    runner = trainer.init_state(llm.jit_args)
    start = RolloutCarry(runner.env_state, runner.obs, runner.hidden, runner.rng, runner.window)
    carry, traj, _, states = jax.jit(lambda c, r, a: trainer.rollout(r.params, c, a, keep_states=True))(
        start, runner, llm.jit_args)
    ids, lengths = jax.vmap(llm.template)(jax.tree.map(lambda x: x[0], states))
    outside = llm.model.encode(np.asarray(ids), np.asarray(lengths), layer=cfg.llm_layer, pooling=cfg.pooling,
                               prefix=llm.prefix_cache)
    np.testing.assert_allclose(np.asarray(traj.hidden[0]), np.asarray(outside), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(outside)).max() > 0


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """`rl.train --encoder inscan --model tiny-moe` (test preset, 3 updates), recording its rollouts."""
    from rl.train import main

    root = tmp_path_factory.mktemp("moe")
    rc = main(["--encoder=inscan", "--preset", "test", "--model", "tiny-moe", "--run-dir", str(root / "run"),
               "--save-trajectories", str(root / "data"), "--samples-per-file", "64", "--quiet"])
    assert rc == 0
    return root


def test_train_and_eval_with_ablations(moe_run):
    from rl.eval import evaluate

    run = moe_run / "run"
    assert json.loads((run / "config.json").read_text())["model"] == "tiny-moe"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["total_loss"]) for r in rows)
    results = evaluate(run, num_episodes=2, max_steps=8, modes=("real", "zero", "shuffled"))
    assert set(results) == {"real", "zero", "shuffled"}
    assert all(np.isfinite(r["return_mean"]) for r in results.values())


@pytest.fixture(scope="module")
def moe_labelled(moe_run):
    """The recording labelled with tiny-moe (float32), and the labeller."""
    from rl.label import LabelConfig, Labeller, label_files

    cfg = LabelConfig(model="tiny-moe", llm_dtype="float32", batch=32)
    labeller = Labeller(cfg)
    files = sorted((moe_run / "data").glob("*.npz"))
    out = moe_run / "labelled"
    summary = label_files(files, out, cfg, quiet=True, labeller=labeller)
    assert summary.files == len(files) and not summary.bad
    return out, labeller


@pytest.fixture(scope="module")
def moe_server(start_tiny_server):
    """`python -m jaxllm.http.server --model tiny-moe` (float32): its URL."""
    return start_tiny_server("--model", "tiny-moe")[0]


def test_label_and_http_server_agree(moe_labelled, moe_server):
    """Recorded files labelled with tiny-moe; the same prompts sent to `jaxllm.http.server --model tiny-moe` give
    the same vectors (up to the labels' float16 rounding and the server's batching)."""
    from jaxllm.http.client import VLLMClient

    out, labeller = moe_labelled
    with np.load(sorted(out.glob("*.npz"))[0]) as f:
        obs, hidden = f["obs"][:6], f["hidden_state"][:6].astype(np.float32)
    template = labeller.template(ENV)
    ids, lengths = jax.jit(jax.vmap(template))(obs)
    ids, lengths = np.asarray(ids), np.asarray(lengths)
    client = VLLMClient(moe_server, timeout=60)
    try:
        served = np.asarray(client.embed([template.prefix_ids + ids[i, :lengths[i]].tolist() for i in range(6)]))
    finally:
        client.close()
    np.testing.assert_allclose(hidden, served, rtol=2e-3, atol=2e-3)


def test_train_against_the_moe_server(moe_server, tmp_path):
    """`rl.train --encoder vllm --model tiny-moe` against the tiny-moe server (the HTTP parity path): 3 updates with
    finite losses, the LLM's share of the time measured."""
    from rl.train import main

    run = tmp_path / "vllm"
    assert main(["--preset", "test", "--env", ENV, "--encoder", "vllm", "--vllm-url", moe_server, "--model", "tiny-moe",
                 "--run-dir", str(run), "--quiet"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["total_loss"]) and 0 < r["llm_time_share"] <= 1 for r in rows)


def test_probe_of_the_moe_run(moe_run):
    """`rl.probe` on the in-scan tiny-moe run: each kind with the LLM modes (real, zero and other_prompt among
    them) finite, the prompt kind's injected text through the MoE encoder."""
    from rl.probe.__main__ import main

    out = moe_run / "probe"
    assert main([str(moe_run / "run"), "--pairs", "2", "--play-steps", "8", "--kinds", "health", "prompt:wood",
                 "--out", str(out), "--trajectories", str(moe_run / "data")]) == 0
    (run,) = json.loads((out / "probe.json").read_text())["runs"]
    assert set(run["kinds"]) == {"health", "prompt:wood"}
    for kind in run["kinds"].values():
        assert {"real", "zero", "other_prompt"} <= set(kind["modes"])
        assert all(np.isfinite(kind["modes"][m]["mean_dv"]) for m in kind["modes"])


def test_offline_awr_on_moe_labels(moe_labelled):
    """`rl.offline train` on the tiny-moe labels, then `rl.offline eval` with a prompt variant, which re-encodes
    its prompts with the labels' model (tiny-moe)."""
    from rl.offline.__main__ import main

    out = moe_labelled[0].parent / "awr"
    assert main(["train", "--data", str(moe_labelled[0]), "--out", str(out), "--hidden", "real", "--steps", "100",
                 "--width", "32", "--batch-size", "32", "--updates-per-dispatch", "50", "--log-every", "50",
                 "--checkpoint-every", "100", "--val-fraction", "0.25", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["labelling"]["model"] == "tiny-moe"
    assert main(["eval", str(out), "--episodes", "1", "--max-steps", "8", "--modes", "real",
                 "--prompt", "terse=You play Craftax."]) == 0
    results = json.loads((out / "eval.json").read_text())
    assert list(results) == ["real", "terse"] and all(np.isfinite(r["return_mean"]) for r in results.values())

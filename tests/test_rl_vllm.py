"""`--encoder vllm` end to end against the project's own vLLM-API server (`python -m jaxllm.http.server`)."""
import json

import jax
import numpy as np
import pytest

from rl.config import PRESETS, TrainConfig
from rl.encoders import VLLMEncoder
from rl.llm import load_llm
from rl.train import main
from rl.trainer import Trainer


@pytest.fixture(scope="module")
def server_url(start_tiny_server):
    url, _ = start_tiny_server("--max-batch", "8")
    return url


def test_vllm_hidden_states_match_inscan_encoder(server_url):
    """The ids the trainer sends (template prefix + ids[:length]) give the in-scan encoder's vectors."""
    cfg = TrainConfig(**dict(PRESETS["test"], encoder="vllm", vllm_url=server_url, num_envs=4))
    llm = load_llm(cfg)  # with the local model, to compare
    trainer = Trainer.from_config(cfg, llm, VLLMEncoder(server_url, llm.template))
    runner = trainer.init_state()
    ids, lengths = jax.vmap(llm.template)(runner.env_state.env_state)
    expect = llm.model.encode(np.asarray(ids), np.asarray(lengths), prefix=llm.prefix_cache)
    np.testing.assert_allclose(np.asarray(runner.hidden), np.asarray(expect), rtol=1e-4, atol=1e-4)


def test_vllm_training_run_end_to_end(server_url, tmp_path):
    run_dir = tmp_path / "vllm"
    rc = main(["--preset", "test", "--encoder", "vllm", "--vllm-url", server_url, "--run-dir", str(run_dir),
               "--quiet"])
    assert rc == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(0 < r["llm_time_share"] <= 1 and np.isfinite(r["total_loss"]) for r in rows)
    assert all(0 <= r["hidden_zero_frac"] <= 1 for r in rows)
    from rl.runs import restore_policy

    policy = restore_policy(run_dir)  # played with the in-scan encoder: its state has no LLM window, its rule zero
    assert policy.step == 3 and policy.runner.window is None and policy.cfg.hidden_on_reset == "zero"

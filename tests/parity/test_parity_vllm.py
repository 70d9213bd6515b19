"""jaxllm vs a running vLLM server on >= 200 real Craftax prompts (bf16): cosine >= 0.999 and relative
L2 <= 2e-2 for every prompt. vLLM needs a CUDA GPU, so this runs on users' machines only:

    scripts/start_vllm.sh Qwen/Qwen3-4B          # in one shell: stock vLLM, raw last-token final state
    VLLM_URL=http://127.0.0.1:8000 VLLM_MODEL=Qwen/Qwen3-4B python -m pytest -rs tests/parity/test_parity_vllm.py

VLLM_MODEL is the checkpoint the server serves, as a local directory or a hub id in the local HF cache
(jaxllm loads the same weights). Optional: VLLM_PARITY_PROMPTS (default 256), VLLM_PARITY_STEPS (default
256 random-policy steps before sampling states). Without VLLM_URL the test is skipped with this recipe.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from jaxllm.parity import vector_errors
from render.sample_prompts import craftax_prompts

VLLM_URL = os.environ.get("VLLM_URL")
VLLM_MODEL = os.environ.get("VLLM_MODEL")
RECIPE = ("start a server with `scripts/start_vllm.sh MODEL`, then run `VLLM_URL=http://127.0.0.1:8000 "
          "VLLM_MODEL=MODEL python -m pytest -rs tests/parity/test_parity_vllm.py`")

pytestmark = [
    pytest.mark.skipif(not VLLM_URL, reason=f"VLLM_URL is not set (vLLM needs a CUDA GPU): {RECIPE}"),
    pytest.mark.skipif(bool(VLLM_URL) and not VLLM_MODEL,
                       reason=f"VLLM_URL is set but VLLM_MODEL (the checkpoint the server serves) is not: {RECIPE}"),
]


def test_jaxllm_matches_vllm_on_craftax_prompts():
    from jaxllm import load_model, load_tokenizer
    from jaxllm.resolve import resolve_checkpoint_dir
    from jaxllm.http.client import VLLMClient

    num_prompts = int(os.environ.get("VLLM_PARITY_PROMPTS", "256"))
    steps = int(os.environ.get("VLLM_PARITY_STEPS", "256"))
    assert num_prompts >= 200, "the parity claim is made on at least 200 prompts"
    ckpt = resolve_checkpoint_dir(VLLM_MODEL)
    tokenizer = load_tokenizer(ckpt if (Path(ckpt) / "tokenizer.json").is_file() else None)
    prompts = craftax_prompts(tokenizer, num_prompts, steps=steps, seed=1)

    with VLLMClient(VLLM_URL, timeout=300, batch_size=32) as client:
        client.health()
        served = client.embed(prompts.whole())

    model = load_model(ckpt, dtype="bfloat16")
    cache = model.prefill(np.asarray(prompts.prefix_ids, np.int32))
    ours = np.concatenate([
        np.asarray(model.encode(prompts.rest_ids[i:i + 32], prompts.lengths[i:i + 32], prefix=cache))
        for i in range(0, num_prompts, 32)])

    assert served.shape == ours.shape, f"server returned {served.shape}, jaxllm {ours.shape}: another model?"
    norms = np.linalg.norm(served, axis=-1)
    assert not np.allclose(norms, 1.0, atol=1e-3), (
        "the server's vectors have unit norm: its pooler L2-normalises. Start it with scripts/start_vllm.sh "
        "(pooling LAST, normalisation off) so it returns the raw final hidden state")
    rel, cos = vector_errors(ours, served)
    summary = (f"cosine min {cos.min():.6f} / median {np.median(cos):.6f}; relative L2 max {rel.max():.3e} / "
               f"median {np.median(rel):.3e} over {num_prompts} prompts")
    print(summary)
    assert cos.min() >= 0.999 and rel.max() <= 2e-2, summary

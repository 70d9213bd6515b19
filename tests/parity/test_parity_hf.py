"""jaxllm vs HF transformers (torch) per hidden-state index on real Craftax prompts, in f32 and bf16.

Both sides load the same random checkpoint (tiny shape, real vocabulary, norm weights != 1) and run the
same whole prompts (~1,000 tokens); every real token of every index is compared.
"""
from __future__ import annotations

import pytest

from jaxllm import load_model
from jaxllm.parity import (collect_hidden_states, compare_hidden_states, format_table, hf_hidden_states,
                           jax_hidden_states)

# Per-token relative L2 and cosine bounds. f32: rounding only. bf16: both sides round activations to bf16
# at the same points (HF numerics), but op order differs; measured ~1e-2 (same as HF bf16 vs HF f32).
BOUNDS = {"float32": (1e-4, 0.99999), "bfloat16": (2e-2, 0.999)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jaxllm_matches_hf_at_every_hidden_state_index(tiny_checkpoint, prompt_set, dtype):
    prompts = prompt_set.whole()
    assert min(map(len, prompts)) > 500  # real prompts: system prompt + observation
    want = collect_hidden_states(hf_hidden_states(tiny_checkpoint, dtype), prompts, batch_size=4)
    got = collect_hidden_states(jax_hidden_states(load_model(tiny_checkpoint, dtype=dtype)), prompts, batch_size=4)
    stats = compare_hidden_states(got, want)
    num_layers = load_model("tiny").config.num_hidden_layers
    assert len(stats.max_rel) == num_layers + 1
    max_rel, min_cos = BOUNDS[dtype]
    table = format_table({f"jaxllm vs HF {dtype}": stats})
    assert (stats.max_rel <= max_rel).all() and (stats.min_cos >= min_cos).all(), table

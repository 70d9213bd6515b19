"""Shared fixtures of the parity suite: real Craftax prompts and a random tiny HF checkpoint.

Prompts come from `render` templates of Craftax-Symbolic-v1 reset states (different worlds; a rollout
would cost a much longer compile on CI's CPUs; `scripts/parity_report.py --steps N` uses random play).
"""
from __future__ import annotations

import pytest

from jaxllm.parity import write_random_checkpoint
from render.sample_prompts import craftax_prompts

NUM_PROMPTS = 8


@pytest.fixture(scope="session")
def tokenizer():
    from jaxllm import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def prompt_set(tokenizer):
    return craftax_prompts(tokenizer, NUM_PROMPTS, env_name="Craftax-Symbolic-v1", fmt="compact", seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The 'tiny' preset's shape (real Qwen3 vocabulary) as a random f32 HF checkpoint on disk."""
    from jaxllm import PRESETS

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-hf"), PRESETS["tiny"], dtype="float32", seed=1)

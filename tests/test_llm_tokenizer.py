"""The default tokenizer is the real Qwen3 one, offline; checkpoint tokenizers; vocabulary checks."""
import numpy as np
import pytest

from jaxllm import PRESETS, Qwen3Config, check_tokenizer, load_model, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_default_tokenizer_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tok = load_tokenizer()
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        151644, 151645, 151667, 151668]
    assert len(tok) == 151669
    text = "Map:\n-5, -4: Darkness\nHealth: 9.0"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok("123")["input_ids"] == [tok.convert_tokens_to_ids(d) for d in "123"]  # digits are single tokens


def test_checkpoint_tokenizer_and_preset_name(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)("hello world")["input_ids"] == tok("hello world")["input_ids"]
    assert load_tokenizer("tiny")("hello")["input_ids"] == tok("hello")["input_ids"]
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "..")


def test_tokenizer_fits_the_tiny_model(tok):
    check_tokenizer(tok, PRESETS["tiny"])
    ids = np.asarray([tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]], np.int32)
    vec = load_model("tiny").encode(ids, np.array([ids.shape[1]]))
    assert vec.shape == (1, 64) and np.isfinite(np.asarray(vec)).all()


def test_tokenizer_larger_than_embedding_is_refused(tok):
    small = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"tokenizer ids go up to 151668 .* 512 rows"):
        check_tokenizer(tok, small)

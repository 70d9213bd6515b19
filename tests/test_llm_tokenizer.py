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


def test_qwen_tokenizer_is_what_autotokenizer_loads_without_importing_torch(tok, tmp_path):
    """load_tokenizer imports the Qwen2 tokenizer class alone (AutoTokenizer's import pulls in torch: seconds at a
    start). It must be the class AutoTokenizer picks, with the same ids and chat framing; a tokenizer of another
    class still goes through AutoTokenizer."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from jaxllm.tokenizer import default_tokenizer_dir, tokenizer_class

    auto = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()), local_files_only=True)
    assert type(tok) is type(auto)
    texts = ["Map:\n-5, -4: Darkness", "  two  spaces\tand\ttabs\n\n", "Ünïcödé 日本語 🙂 <|im_end|> 12345"]
    assert tok(texts, add_special_tokens=False)["input_ids"] == auto(texts, add_special_tokens=False)["input_ids"]
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert tok.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)

    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_class(tmp_path) is AutoTokenizer

    code = ("import sys; from jaxllm import load_tokenizer; t = load_tokenizer(); t('hi'); "
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}], tokenize=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr

"""Bad input gives one clear error naming the file and field (never a silent partial load)."""
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from jaxllm import CheckpointError, ConfigError, ModelNotFoundError, load_model  # noqa: E402


def _save(path, causal, tie):
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   tie_word_embeddings=tie)
    cls = transformers.Qwen3ForCausalLM if causal else transformers.Qwen3Model
    cls(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid 2-layer ForCausalLM checkpoint (untied, so it has lm_head.weight)."""
    return _save(tmp_path_factory.mktemp("good") / "ckpt", causal=True, tie=False)


@pytest.fixture
def copy(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def edit_config(path, **changes):
    d = json.loads((path / "config.json").read_text())
    d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


def edit_weights(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_good_checkpoint_loads(good):
    model = load_model(good, dtype=jnp.float32)
    assert model.config.num_hidden_layers == 2 and "lm_head" in model.params


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json.*not found"):
        load_model(copy)


def test_corrupt_config(copy):
    (copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_model(copy)


def test_non_qwen3_architecture(copy):
    edit_config(copy, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match=r"config\.json: field 'model_type' is 'llama'"):
        load_model(copy)


def test_missing_config_field(copy):
    d = json.loads((copy / "config.json").read_text())
    del d["hidden_size"]
    (copy / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"field 'hidden_size' is missing"):
        load_model(copy)


def test_missing_weights_file(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights found; expected model\.safetensors"):
        load_model(copy)


def test_corrupt_weights_file(copy):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or unreadable"):
        load_model(copy)


def test_missing_tensor(copy):
    edit_weights(copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(copy)


def test_missing_untied_lm_head(copy):
    edit_weights(copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*'lm_head\.weight'"):
        load_model(copy)


def test_bare_untied_model_has_no_logits(tmp_path):
    model = load_model(_save(tmp_path / "bare", causal=False, tie=False))
    assert "lm_head" not in model.params
    assert model.encode(np.ones((1, 3), np.int32), np.array([3])).shape == (1, 32)
    with pytest.raises(ValueError, match="no 'lm_head' weight"):
        model.logits(np.ones((1, 3), np.int32))


def test_wrong_shape(copy):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]
    edit_weights(copy, shrink)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj"
                                              r"\.weight' has shape \(8, 32\), expected \(16, 32\)"):
        load_model(copy)


def test_extra_layer_does_not_match_config(copy):
    edit_config(copy, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\."):
        load_model(copy)


def test_missing_shard(tmp_path):
    path = tmp_path / "sharded"
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    transformers.Qwen3Model(cfg).save_pretrained(path, max_shard_size="20KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"{shards[-1].name}: shard listed in .* is missing"):
        load_model(path)


def test_unknown_name_or_uncached_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"hf download Qwen/Qwen3-4B"):
        load_model("Qwen/Qwen3-4B")
    with pytest.raises(ModelNotFoundError, match=r"not a local directory, a preset"):
        load_model("no-such-model")


def test_bad_call_arguments():
    model = load_model("tiny")
    ids = np.ones((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"ids has token ids outside \[0, 151936\)"):
        model.encode(np.full((2, 4), 151936), np.array([4, 4]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=4\]"):
        model.encode(ids, np.array([5, 1]))
    with pytest.raises(ValueError, match=r"lengths must be integers of shape \[2\]"):
        model.encode(ids, np.array([4]))
    with pytest.raises(ValueError, match=r"layer=3 is out of range.*-3\.\.2"):
        model.encode(ids, np.array([4, 4]), layer=3)
    with pytest.raises(ValueError, match=r"pooling must be one of"):
        model.encode(ids, np.array([4, 4]), pooling="max")
    with pytest.raises(ValueError, match=r"prefix_ids must be integer token ids of shape \[P\]"):
        model.prefill(ids)
    with pytest.raises(ValueError, match=r"dtype int32 is not supported"):
        load_model("tiny", dtype="int32")

"""Qwen3Config parsing (both RoPE forms, HF defaults), presets, and refusal of non-Qwen3 configs."""
import jax
import pytest

transformers = pytest.importorskip("transformers")

from jaxllm import PRESETS, ConfigError, Qwen3Config  # noqa: E402


def hf_dict(**overrides):
    cfg = transformers.Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                                   tie_word_embeddings=False, **overrides)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3ForCausalLM"]
    return d


def test_rope_parameters_and_legacy_rope_theta_give_the_same_config():
    new = hf_dict()
    assert "rope_parameters" in new
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"} | {"rope_theta": 5e6}
    a, b = Qwen3Config.from_hf_dict(new), Qwen3Config.from_hf_dict(legacy)
    assert a == b and hash(a) == hash(b)
    assert (a.rope_theta, a.head_dim, a.tie_word_embeddings, a.num_key_value_heads) == (5e6, 32, False, 2)


def test_head_dim_and_kv_heads_default_like_hf():
    d = hf_dict()
    del d["head_dim"], d["num_key_value_heads"]
    c = Qwen3Config.from_hf_dict(d)
    assert c.head_dim == 16 and c.num_key_value_heads == 4


def test_config_is_a_static_jit_argument():
    f = jax.jit(lambda x, config: x * config.hidden_size, static_argnums=1)
    assert int(f(2, PRESETS["tiny"])) == 128


def test_presets():
    big, tiny = PRESETS["qwen3-4b"], PRESETS["tiny"]
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads,
            big.head_dim, big.intermediate_size, big.vocab_size, big.rope_theta, big.tie_word_embeddings) == (
        2560, 36, 32, 8, 128, 9728, 151936, 1e6, True)
    assert (tiny.vocab_size, tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers,
            tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim) == (151936, 64, 192, 2, 4, 2, 16)


@pytest.mark.parametrize("change,field", [
    ({"model_type": "qwen2"}, "model_type"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "architectures"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=rf"my/config\.json: .*{field}"):
        Qwen3Config.from_hf_dict(hf_dict() | change, source="my/config.json")

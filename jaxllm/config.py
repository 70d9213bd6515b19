"""Qwen3 model configuration: HF field names, presets, and parsing of HF `config.json` files."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
QWEN3_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3MoeModel")
MODEL_TYPES = {"qwen3": QWEN3_ARCHITECTURES, "qwen3_moe": QWEN3_MOE_ARCHITECTURES}


class ConfigError(ValueError):
    """A config.json (or config dict) that does not describe a Qwen3 model (dense or MoE)."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Shape and numerics of a Qwen3 decoder, dense or mixture-of-experts (Qwen3-MoE, e.g. Qwen3-30B-A3B).
    Frozen and hashable: usable as a static jit argument.

    Field names follow Hugging Face `Qwen3Config` / `Qwen3MoeConfig`. `num_experts` 0 is a dense model; otherwise
    layer i has a sparse MoE block when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0
    (`sparse_layers`), and a dense MLP of width `intermediate_size` elsewhere.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"Qwen3Config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"Qwen3Config.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError(f"Qwen3Config.rope_theta and rms_norm_eps must be > 0, got "
                              f"{self.rope_theta!r}, {self.rms_norm_eps!r}")
        if self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ConfigError(f"Qwen3Config.{name} must be a positive int for an MoE model, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"Qwen3Config.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                                  f"num_experts ({self.num_experts})")
            if not isinstance(self.mlp_only_layers, tuple) or any(
                    not isinstance(i, int) or not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
                raise ConfigError(f"Qwen3Config.mlp_only_layers must be a tuple of layer indices in "
                                  f"[0, {self.num_hidden_layers}), got {self.mlp_only_layers!r}")

    @property
    def is_moe(self) -> bool:
        """Whether any layer has a sparse mixture-of-experts block."""
        return any(self.sparse_layers)

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: True where it has a sparse MoE block (HF's rule), False where a dense MLP."""
        if not self.num_experts:
            return (False,) * self.num_hidden_layers
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_hidden_layers))

    @property
    def q_size(self) -> int:
        """Width of the concatenated query heads."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the concatenated key (or value) heads."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config dict") -> "Qwen3Config":
        """Builds a config from a HF `config.json` dict (both `rope_theta` and `rope_parameters` forms).

        Refuses anything that is not a Qwen3 or Qwen3-MoE decoder, naming `source` and the offending field.
        """
        def fail(field: str, why: str) -> ConfigError:
            return ConfigError(f"{source}: field '{field}' {why}")

        model_type = d.get("model_type")
        if model_type is not None and model_type not in MODEL_TYPES:
            raise fail("model_type", f"is {model_type!r}; jaxllm supports Qwen3 ('qwen3') and Qwen3-MoE "
                                     f"('qwen3_moe')")
        archs = d.get("architectures")
        if archs:
            allowed = MODEL_TYPES[model_type] if model_type else QWEN3_ARCHITECTURES + QWEN3_MOE_ARCHITECTURES
            unsupported = [a for a in archs if a not in allowed]
            if unsupported:
                raise fail("architectures", f"is {archs!r}; supported: {list(allowed)}")
            if model_type is None:
                model_type = "qwen3_moe" if archs[0] in QWEN3_MOE_ARCHITECTURES else "qwen3"
        if model_type is None:
            raise fail("model_type", "is missing (and so is 'architectures'); expected model_type 'qwen3' or "
                                     "'qwen3_moe'")
        if d.get("hidden_act", "silu") != "silu":
            raise fail("hidden_act", f"is {d['hidden_act']!r}; Qwen3 uses 'silu'")
        if d.get("attention_bias", False):
            raise fail("attention_bias", "is true; Qwen3 attention has no bias")
        if d.get("use_sliding_window", False):
            raise fail("use_sliding_window", "is true; sliding-window attention is not supported")

        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")
        if rope_params is not None:
            rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rope_type != "default":
                raise fail("rope_parameters.rope_type", f"is {rope_type!r}; only 'default' RoPE is supported")
            rope_theta = rope_params.get("rope_theta", rope_theta)
        rope_scaling = d.get("rope_scaling")
        if rope_scaling:
            raise fail("rope_scaling", f"is {rope_scaling!r}; RoPE scaling is not supported")
        if rope_theta is None:
            raise fail("rope_theta", "is missing (neither 'rope_theta' nor 'rope_parameters.rope_theta' is set)")

        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for name in required:
            if name not in d:
                raise fail(name, "is missing")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        kv_heads = d.get("num_key_value_heads") or num_heads
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            # transformers 5 writes the expert count as num_local_experts; the hub's configs say num_experts
            num_experts = d.get("num_experts", d.get("num_local_experts"))
            for name, value in (("num_experts", num_experts), ("num_experts_per_tok", d.get("num_experts_per_tok")),
                                ("moe_intermediate_size", d.get("moe_intermediate_size"))):
                if value is None:
                    raise fail(name, "is missing; a qwen3_moe config needs it")
            if d.get("shared_expert_intermediate_size"):
                raise fail("shared_expert_intermediate_size", "is set; Qwen3-MoE has no shared expert")
            moe = dict(num_experts=num_experts, num_experts_per_tok=d["num_experts_per_tok"],
                       moe_intermediate_size=d["moe_intermediate_size"],
                       # transformers' Qwen3MoeConfig defaults norm_topk_prob to false (the hub's 30B-A3B sets true)
                       norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                       decoder_sparse_step=d.get("decoder_sparse_step", 1),
                       mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=d.get("max_position_embeddings", 40960),
                initializer_range=float(d.get("initializer_range", 0.02)),
                **moe,
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "Qwen3Config":
        """Reads a HF `config.json` file."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found; a Qwen3 checkpoint directory needs a config.json")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
        return cls.from_hf_dict(d, source=str(path))


PRESETS: dict[str, Qwen3Config] = {
    # Published Qwen/Qwen3-4B config.json.
    "qwen3-4b": Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=40960),
    # CPU-sized Qwen3 with the real vocabulary, so the real tokenizer works with it.
    "tiny": Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=40960),
    # Published Qwen/Qwen3-30B-A3B config.json: 48 sparse layers, 128 experts, 8 per token.
    "qwen3-30b-a3b": Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=False, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # CPU-sized Qwen3-MoE with the real vocabulary: 8 experts, 2 per token, every layer sparse.
    "tiny-moe": Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=40960,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}

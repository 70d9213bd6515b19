"""jaxllm vs HF transformers (torch, CPU) on tiny random Qwen3 checkpoints written with save_pretrained.

Error metric: max |ours - hf| / max |hf| over a whole tensor (an element-wise relative error is undefined near
zero). Bounds: 1e-4 in float32 (summation-order noise is ~1e-6), 2e-2 in bfloat16 (a few bf16 ulps, 2**-8 each).
"""
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm import load_model  # noqa: E402

F32_TOL, BF16_TOL = 1e-4, 2e-2
VOCAB = 512


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def write_checkpoint(path, *, causal, tie, disk_dtype, head_dim, rope_theta, legacy_rope, shard=None, seed=0):
    """Saves a random 3-layer Qwen3 like the hub ones; returns its HF class for reloading."""
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, tie_word_embeddings=tie, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    torch.manual_seed(seed)
    cls = transformers.Qwen3ForCausalLM if causal else transformers.Qwen3Model
    model = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a norm loaded wrongly shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(disk_dtype)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    if legacy_rope:  # the pre-transformers-5 form of the same config
        d = json.loads((path / "config.json").read_text())
        d["rope_theta"] = d.pop("rope_parameters")["rope_theta"]
        (path / "config.json").write_text(json.dumps(d))
    return cls


def hf_reference(path, cls, dtype):
    """The checkpoint as HF loads it (from disk, so buffers such as RoPE's inv_freq are rebuilt in float32)."""
    return cls.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (checkpoint dir, HF class)."""
    root = tmp_path_factory.mktemp("qwen3_ckpts")
    specs = {
        # Published-4B-like layout: ForCausalLM, bf16 on disk; plus untied, sharded, head_dim != D/H, theta 1e4.
        "causal_untied_sharded": dict(causal=True, tie=False, disk_dtype=torch.bfloat16, head_dim=32,
                                      rope_theta=10_000.0, legacy_rope=False, shard="40KB"),
        "causal_tied": dict(causal=True, tie=True, disk_dtype=torch.bfloat16, head_dim=16,
                            rope_theta=1_000_000.0, legacy_rope=True, seed=1),
        "bare_tied": dict(causal=False, tie=True, disk_dtype=torch.float32, head_dim=16,
                          rope_theta=1_000_000.0, legacy_rope=True, seed=2),
    }
    out = {}
    for name, spec in specs.items():
        out[name] = (root / name, write_checkpoint(root / name, **spec))
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, 13)).astype(np.int32)


def hf_hidden_states(path, cls, ids, dtype):
    model = hf_reference(path, cls, dtype)
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
    return [h.float().numpy() for h in out.hidden_states]


def test_checkpoint_forms_cover_the_issue(ckpts):
    sharded_dir, _ = ckpts["causal_untied_sharded"]
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" in index["weight_map"]
    assert "rope_parameters" in json.loads((sharded_dir / "config.json").read_text())
    tied_cfg = json.loads((ckpts["causal_tied"][0] / "config.json").read_text())
    assert "rope_theta" in tied_cfg and "rope_parameters" not in tied_cfg


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["causal_untied_sharded", "causal_tied", "bare_tied"])
def test_every_hidden_state_matches_hf(ckpts, ids, name, dtype, tol):
    path, cls = ckpts[name]
    model = load_model(path, dtype=dtype)
    assert model.params["embed_tokens"].dtype == dtype
    ours = model.hidden_states(ids)
    ref = hf_hidden_states(path, cls, ids, torch.float32 if dtype == jnp.float32 else torch.bfloat16)
    assert len(ours) == len(ref) == 4
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape
        assert rel_err(a, b) <= tol, f"hidden state {i}: rel err {rel_err(a, b):.2e} > {tol}"


@pytest.mark.parametrize("name", ["causal_untied_sharded", "causal_tied"])
def test_logits_match_hf_lm_head(ckpts, ids, name):
    path, cls = ckpts[name]
    model = load_model(path, dtype=jnp.float32)
    assert ("lm_head" in model.params) == (not model.config.tie_word_embeddings)
    with torch.no_grad():
        ref = hf_reference(path, cls, torch.float32)(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    assert rel_err(model.logits(ids), ref) <= F32_TOL


@pytest.fixture(scope="module")
def f32_pair(ckpts):
    path, cls = ckpts["causal_untied_sharded"]
    return load_model(path, dtype=jnp.float32), hf_reference(path, cls, torch.float32)


def hf_pooled(hf_model, seq, layer, pooling):
    with torch.no_grad():
        hs = hf_model(torch.as_tensor(np.asarray(seq)[None], dtype=torch.long), output_hidden_states=True).hidden_states
    h = hs[layer][0].numpy()
    return h[-1] if pooling == "last" else h.mean(axis=0)


def right_pad(seqs, width, rng):
    """Right-padded [B, width] with random (not zero) pad ids, to show pads never leak into real tokens."""
    ids = rng.integers(0, VOCAB, size=(len(seqs), width)).astype(np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return ids, np.array([len(s) for s in seqs], np.int32)


@pytest.mark.parametrize("layer", [0, 2, -2, -1])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_right_padded_batch_pools_like_hf_per_sequence(f32_pair, layer, pooling):
    model, hf_model = f32_pair
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, VOCAB, size=n) for n in (11, 3, 7)]
    ids, lengths = right_pad(seqs, 12, rng)
    vec = np.asarray(model.encode(ids, lengths, layer=layer, pooling=pooling))
    assert vec.dtype == np.float32 and vec.shape == (3, 64)
    for row, seq in enumerate(seqs):
        assert rel_err(vec[row], hf_pooled(hf_model, seq, layer, pooling)) <= F32_TOL


@pytest.mark.parametrize("layer", [0, 1, -1])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prefix_cache_equals_full_prompt(f32_pair, layer, pooling):
    model, hf_model = f32_pair
    rng = np.random.default_rng(2)
    head = rng.integers(0, VOCAB, size=6)
    rests = [rng.integers(0, VOCAB, size=n) for n in (5, 1, 8, 0)]
    rest_ids, rest_len = right_pad(rests, 8, rng)
    full_ids, full_len = right_pad([np.concatenate([head, r]) for r in rests], 14, rng)
    cache = model.prefill(head)
    assert cache.length == 6
    cached = np.asarray(model.encode(rest_ids, rest_len, layer=layer, pooling=pooling, prefix=cache))
    full = np.asarray(model.encode(full_ids, full_len, layer=layer, pooling=pooling))
    assert rel_err(cached, full) <= F32_TOL
    for row, rest in enumerate(rests):
        ref = hf_pooled(hf_model, np.concatenate([head, rest]), layer, pooling)
        assert rel_err(cached[row], ref) <= F32_TOL


def test_prefix_cache_equals_full_prompt_bf16(ckpts):
    model = load_model(ckpts["causal_tied"][0], dtype=jnp.bfloat16)
    rng = np.random.default_rng(3)
    head = rng.integers(0, VOCAB, size=9)
    rests = [rng.integers(0, VOCAB, size=n) for n in (4, 6)]
    rest_ids, rest_len = right_pad(rests, 6, rng)
    full_ids, full_len = right_pad([np.concatenate([head, r]) for r in rests], 15, rng)
    cache = model.prefill(head)
    for pooling in ("last", "mean"):
        cached = model.encode(rest_ids, rest_len, pooling=pooling, prefix=cache)
        full = model.encode(full_ids, full_len, pooling=pooling)
        assert rel_err(cached, full) <= BF16_TOL

"""Qwen3-MoE (Qwen3-30B-A3B's architecture) against HF transformers' Qwen3MoeForCausalLM / Qwen3MoeModel on small
random checkpoints written with save_pretrained (per-expert keys, as the hub publishes them).

Error metric and bound as tests/test_llm_parity.py: max |ours - hf| / max |hf| per tensor, 1e-4 in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm import CheckpointError, ConfigError, Qwen3Config, encode_packed, load_model  # noqa: E402
from jaxllm import moe  # noqa: E402
from jaxllm.config import PRESETS  # noqa: E402

F32_TOL = 1e-4
VOCAB = 256

# name -> (norm_topk_prob, decoder_sparse_step, mlp_only_layers, top_k, ForCausalLM?, shard)
SPECS = {
    "topk2_norm_dense_layer": (True, 1, [1], 2, True, None),
    "top1_nonorm_step2": (False, 2, [], 1, True, None),
    "topk3_bare_sharded": (True, 1, [], 3, False, "60KB"),
}


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def hf_config(norm, step, mlp_only, top_k, **extra):
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=top_k,
        norm_topk_prob=norm, decoder_sparse_step=step, mlp_only_layers=mlp_only, hidden_act="silu",
        tie_word_embeddings=False, max_position_embeddings=256, **extra)


def save_random(path, cfg, causal=True, shard=None, seed=0, scale=0.2):
    torch.manual_seed(seed)
    model = (transformers.Qwen3MoeForCausalLM if causal else transformers.Qwen3MoeModel)(cfg).eval()
    with torch.no_grad():  # large enough weights that routing is decisive and every expert sees tokens
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (checkpoint dir, the HF model)."""
    root = tmp_path_factory.mktemp("moe_ckpts")
    out = {}
    for name, (norm, step, mlp_only, top_k, causal, shard) in SPECS.items():
        out[name] = (root / name, save_random(root / name, hf_config(norm, step, mlp_only, top_k), causal, shard))
    return out


IDS = np.random.default_rng(0).integers(0, VOCAB, (3, 13))


@pytest.mark.parametrize("name", list(SPECS))
def test_hidden_states_match_transformers(ckpts, name):
    path, hf = ckpts[name]
    model = load_model(path, dtype="float32")
    norm, step, mlp_only, top_k, causal, _ = SPECS[name]
    assert model.config.norm_topk_prob == norm and model.config.num_experts_per_tok == top_k
    assert model.config.sparse_layers == tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(3))
    with torch.no_grad():
        want = [h.numpy() for h in hf(torch.tensor(IDS), output_hidden_states=True).hidden_states]
    got = model.hidden_states(IDS)
    assert len(got) == len(want) == 4
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel_err(g, w) < F32_TOL, (name, i, rel_err(g, w))
    if causal:
        with torch.no_grad():
            logits = hf(torch.tensor(IDS)).logits.numpy()
        assert rel_err(model.logits(IDS), logits) < F32_TOL


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_encode_with_and_without_prefix_and_packed_match_transformers(ckpts, pooling):
    path, hf = ckpts["topk2_norm_dense_layer"]
    model = load_model(path, dtype="float32")
    rng = np.random.default_rng(1)
    head = rng.integers(0, VOCAB, 7)
    lengths = np.array([5, 9, 1, 12])
    rest = np.zeros((4, 12), np.int64)
    for r, n in enumerate(lengths):
        rest[r, :n] = rng.integers(0, VOCAB, n)
    for layer in (1, 2, -1):
        want = []
        for r, n in enumerate(lengths):
            full = np.concatenate([head, rest[r, :n]])[None]
            with torch.no_grad():
                h = hf(torch.tensor(full), output_hidden_states=True).hidden_states[layer][0].numpy()
            want.append(h[-1] if pooling == "last" else h.mean(0))
        want = np.stack(want)
        cache = model.prefill(head)
        with_prefix = model.encode(rest, lengths, layer=layer, pooling=pooling, prefix=cache)
        assert rel_err(with_prefix, want) < F32_TOL, (layer, "prefix")
        full_ids = np.zeros((4, 19), np.int64)
        for r, n in enumerate(lengths):
            full_ids[r, :7 + n] = np.concatenate([head, rest[r, :n]])
        assert rel_err(model.encode(full_ids, lengths + 7, layer=layer, pooling=pooling), want) < F32_TOL
        packed = encode_packed(model.params, model.config, jnp.asarray(rest), jnp.asarray(lengths), layer=layer,
                               pooling=pooling, prefix=cache, capacity=32)
        assert rel_err(packed, want) < F32_TOL, (layer, "packed")


def test_dropless_when_every_token_picks_the_same_expert(tmp_path):
    """A router that sends every token to expert 3 first: nothing is dropped, the result equals transformers'."""
    cfg = hf_config(True, 1, [], 2)
    hf = save_random(tmp_path, cfg)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(0.01)
            layer.mlp.gate.weight[3] = 5.0 * layer.input_layernorm.weight.sign()  # expert 3 dominates
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(40, 32)), jnp.float32)
    router = model.params["experts"]["router"][0]
    _, experts = moe.route(jnp.abs(x), router, 2, True)
    assert (np.asarray(experts)[:, 0] == 3).all()
    assert int(moe.expert_load(experts, 6)[3]) == 40
    with torch.no_grad():
        want = [h.numpy() for h in hf(torch.tensor(IDS), output_hidden_states=True).hidden_states]
    for g, w in zip(model.hidden_states(IDS), want):
        assert rel_err(g, w) < F32_TOL


def test_routing_follows_transformers_router():
    """Softmax in float32 over all experts, top-k, renormalised only with norm_topk_prob."""
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(20, 16)).astype(np.float32), rng.normal(size=(6, 16)).astype(np.float32)
    for norm in (True, False):
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
            hf_config(norm, 1, [], 3).__class__(hidden_size=16, num_experts=6, num_experts_per_tok=3,
                                                  norm_topk_prob=norm))
        with torch.no_grad():
            router.weight.copy_(torch.tensor(w))
            _, want_w, want_i = router(torch.tensor(x))
        got_w, got_i = moe.route(jnp.asarray(x), jnp.asarray(w.T), 3, norm)
        np.testing.assert_array_equal(np.asarray(got_i), want_i.numpy())
        np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pair_sort", [False, True])
def test_dispatch_is_a_permutation_grouped_by_expert(pair_sort, monkeypatch):
    """Either sort (one combined int32 key, or 16-bit expert keys with the slots as payload, `moe.PAIR_SORT`)."""
    monkeypatch.setattr(moe, "PAIR_SORT", pair_sort)
    experts = jnp.asarray(np.random.default_rng(4).integers(0, 5, (30, 2)), jnp.int32)
    plan = moe.dispatch(experts, 5)
    if pair_sort:  # the sort XLA hands to CUB as a pair sort: unsigned 16-bit keys, the slots as payload
        text = jax.jit(lambda e: moe.dispatch(e, 5)).lower(experts).as_text()
        assert "ui16" in text and "stablehlo.sort" in text
    flat = np.asarray(experts).reshape(-1)
    order, inverse = np.asarray(plan.order), np.asarray(plan.inverse)
    assert sorted(order) == list(range(60)) and (order[inverse] == np.arange(60)).all()
    assert (np.diff(flat[order]) >= 0).all()
    np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))  # within an expert, slots keep their order
    np.testing.assert_array_equal(np.asarray(plan.group_sizes), np.bincount(flat, minlength=5))
    np.testing.assert_array_equal(np.asarray(plan.expert), flat[order])  # each sorted row's expert


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA's sort rewrite to CUB happens on a GPU")
@pytest.mark.parametrize("pair_sort", [False, True])
def test_compiled_dispatch_sorts_by_cub_radix_sort(pair_sort, monkeypatch):
    """Qwen3-30B-A3B's dispatch at one 36,864-token pass (294,912 slots, 128 experts): either sort compiles to
    CUB's radix sort, not XLA's comparison sort, and gives the stable order."""
    monkeypatch.setattr(moe, "PAIR_SORT", pair_sort)
    jax.clear_caches()  # the sort is chosen at trace time
    experts = jax.random.randint(jax.random.key(3), (36864, 8), 0, 128, jnp.int32)
    compiled = jax.jit(lambda e: moe.dispatch(e, 128)).lower(experts).compile()
    text = compiled.as_text()
    # XLA's CUB sorts: "xla.gpu.ext.cub_sort_keys" / "cub_sort_pairs" (jax 0.11.2), "__cub$DeviceRadixSort" before
    assert "cub_sort_pairs" in text if pair_sort else ("cub_sort_keys" in text or "DeviceRadixSort" in text), \
        [line for line in text.splitlines() if "sort" in line.lower()][:6]
    assert " sort(" not in text
    order = np.asarray(compiled(experts).order)
    np.testing.assert_array_equal(order, np.argsort(np.asarray(experts).reshape(-1), kind="stable"))


@pytest.mark.parametrize("used", [[0, 1, 2, 3, 4, 5, 6], [2, 3, 5], [0, 6], [4]])
def test_group_sizes_count_every_expert_with_empty_ones_anywhere(used):
    """Empty experts first, between used ones and last, and every slot on one expert: the group sizes equal a
    count of each expert's slots, and the tile layout names every slot's row once."""
    rng = np.random.default_rng(len(used))
    experts = jnp.asarray(rng.choice(used, (23, 3)), jnp.int32)
    plan = moe.dispatch(experts, 7)
    flat = np.asarray(experts).reshape(-1)
    np.testing.assert_array_equal(np.asarray(plan.group_sizes), np.bincount(flat, minlength=7))
    _, source, row_of_slot = moe._tile_layout(plan, 23, 3, 8, 0)
    row_of_slot = np.asarray(row_of_slot)
    assert len(set(row_of_slot)) == flat.size  # a row per slot
    np.testing.assert_array_equal(np.asarray(source)[row_of_slot], np.arange(flat.size) // 3)  # its token


def test_fused_expert_checkpoint_and_streamed_load_equal_per_expert(ckpts, tmp_path):
    """transformers' fused layout (experts.gate_up_proj / experts.down_proj) loads to the same params, and so does
    the layer-by-layer streamed path for big stacks."""
    from safetensors.numpy import load_file, save_file

    path, _ = ckpts["topk2_norm_dense_layer"]
    tensors = load_file(str(path / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = np.stack([np.concatenate([tensors[f"{p}.{e}.gate_proj.weight"],
                                                               tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(6)])
        fused[f"{p}.down_proj"] = np.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(6)])
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    base = load_model(path, dtype="float32").params
    from jaxllm.weights import load_params

    config = Qwen3Config.from_json(path / "config.json")
    for params in (load_model(tmp_path, dtype="float32").params,
                   load_params(path, config, jnp.float32, host_stack_bytes=0)):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, base)


def _rewrite(path, dst, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    dst.mkdir(exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((path / "config.json").read_text())
    return dst


def test_bad_expert_tensors_fail_in_one_line_naming_the_key(ckpts, tmp_path):
    path, _ = ckpts["topk2_norm_dense_layer"]
    key = "model.layers.0.mlp.experts.4.up_proj.weight"
    cases = {
        "missing": (lambda t: t.pop(key), key),
        "misshapen": (lambda t: t.__setitem__(key, np.zeros((16, 31), np.float32)), key),
        "extra": (lambda t: t.__setitem__("model.layers.0.mlp.experts.6.up_proj.weight", t[key]),
                  "model.layers.0.mlp.experts.6.up_proj.weight"),
    }
    for case, (edit, named) in cases.items():
        with pytest.raises(CheckpointError) as info:
            load_model(_rewrite(path, tmp_path / case, edit), dtype="float32")
        message = str(info.value)
        assert named in message and "\n" not in message, (case, message)
    assert "num_experts=6" in str(info.value)


def test_config_forms_and_errors():
    hub = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
           "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 1e6, "num_experts": 128,
           "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
           "max_position_embeddings": 40960}
    assert Qwen3Config.from_hf_dict(hub) == PRESETS["qwen3-30b-a3b"]
    v5 = dict(hub, num_local_experts=hub.pop("num_experts"))  # transformers 5 writes this name
    assert Qwen3Config.from_hf_dict(v5).num_experts == 128
    assert not Qwen3Config.from_hf_dict({k: v for k, v in hub.items() if k != "norm_topk_prob"} |
                                        {"num_experts": 128}).norm_topk_prob  # transformers' default
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        Qwen3Config.from_hf_dict({k: v for k, v in hub.items() if k != "num_experts_per_tok"} | {"num_experts": 4})
    with pytest.raises(ConfigError, match="architectures"):
        Qwen3Config.from_hf_dict(dict(hub, num_experts=4, architectures=["Qwen3ForCausalLM"]))


def test_tiny_moe_preset_encodes_real_template_prompts():
    """tiny-moe: the real vocabulary, so the real tokenizer's ids run through it (the CPU path of every tool)."""
    from jaxllm import load_tokenizer

    tok = load_tokenizer()
    model = load_model("tiny-moe")
    assert model.config.is_moe and model.config.vocab_size >= len(tok)
    ids = np.array([tok("You are playing Craftax. Health: 9")["input_ids"]])
    vec = model.encode(ids, np.array([ids.shape[1]]))
    assert vec.shape == (1, 64) and np.isfinite(np.asarray(vec)).all()


def test_fp8_moe_quantizes_attention_and_stays_close():
    """fp8 on an MoE model: attention matrices and experts W8A8 (experts stacked in e4m3), the router 16-bit; the
    vectors stay near float32's (tiny-moe at its init scale; routing near-ties may flip an expert, docs/PARITY.md)."""
    from jaxllm.fp8 import Fp8Matrix, quantize_out_in

    f32, q = load_model("tiny-moe", dtype="float32"), load_model("tiny-moe", dtype="fp8")
    assert isinstance(q.params["layers"]["q_proj"], Fp8Matrix)
    assert isinstance(q.params["experts"]["gate_up"], Fp8Matrix) and q.params["experts"]["gate_up"].weight.shape == (
        2, 8, 128, 64)
    assert not isinstance(q.params["experts"]["router"], Fp8Matrix)
    # drawn and quantised one layer at a time = the whole bfloat16 stack quantised at once (on a GPU XLA may skip
    # the bfloat16 rounding before the quantisation inside the fused init: then a few values sit one e4m3 step away)
    bf16 = load_model("tiny-moe", dtype="bfloat16").params["experts"]["down"]
    want = np.asarray(quantize_out_in(bf16).weight, np.float32)
    got = np.asarray(q.params["experts"]["down"].weight, np.float32)
    np.testing.assert_allclose(got, want, rtol=0.13, atol=2.0 ** -9)
    assert np.mean(got != want) < 0.01
    ids = np.random.default_rng(6).integers(0, 150000, (4, 24))
    a = np.asarray(f32.encode(ids, np.full(4, 24)))
    b = np.asarray(q.encode(ids, np.full(4, 24)))
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() > 0.99, cos


@pytest.mark.parametrize("fused_combine", [False, True])
def test_fp8_moe_residual_steps_on_the_one_pass_kernel_match_the_xla_forms(fused_combine, monkeypatch):
    """fp8 MoE layers on a GPU's residual kernels (forced on, Pallas's interpreter): the step after attention
    writes the router's 16-bit rows and the experts' e4m3 rows in one pass (the experts quantise nothing again),
    the step after the MoE block adds its combined rows (`FUSED_MOE_COMBINE`: combines and adds them in one
    kernel); the vectors equal the XLA
    forms' up to the ulp-level RMS differences of a sum of squares in another order, padded and packed (tiny-moe:
    at its init scale those differences flip no expert; `tests/test_llm_fp8.py` and `tests/test_llm_moe_rows.py`
    check the steps' outputs themselves)."""
    import contextlib
    import functools

    from jaxllm import encode, fp8_kernels, layer_ops, moe_rows
    from jaxllm.fp8 import native_fp8_available

    with pytest.warns(UserWarning, match="emulated") if not native_fp8_available() else contextlib.nullcontext():
        model = load_model("tiny-moe", dtype="fp8")
    rng = np.random.default_rng(8)
    ids = jnp.asarray(rng.integers(0, 150000, size=(3, 18)), jnp.int32)
    lengths = jnp.asarray([18, 11, 4], jnp.int32)
    # fresh functions each run: the kernels are chosen at trace time
    run = lambda: [np.asarray(f(model.params, ids, lengths), np.float32) for f in (  # noqa: E731
        jax.jit(lambda p, i, n: encode(p, model.config, i, n)),
        jax.jit(lambda p, i, n: encode_packed(p, model.config, i, n, capacity=32)))]
    want = run()
    monkeypatch.setattr(layer_ops, "native_fp8_available", lambda: True)
    monkeypatch.setattr(layer_ops, "FUSED_MOE_COMBINE", fused_combine)
    kept, given = [], []
    residual = functools.partial(fp8_kernels.residual_norm_quantize_pallas, interpret=True)
    heads = functools.partial(fp8_kernels.head_norm_rope_pallas, interpret=True)
    monkeypatch.setattr(fp8_kernels, "residual_norm_quantize_pallas",
                        lambda *a, **kw: kept.append(kw["keep_normed"]) or residual(*a, **kw))
    monkeypatch.setattr(fp8_kernels, "head_norm_rope_pallas", heads)
    combined = functools.partial(moe_rows.combine_residual_norm_quantize_pallas, interpret=True)
    monkeypatch.setattr(moe_rows, "combine_residual_norm_quantize_pallas",
                        lambda *a, **kw: kept.append(("combine", kw["keep_normed"])) or combined(*a, **kw))
    experts = moe._fp8_expert_outputs
    monkeypatch.setattr(moe, "_fp8_expert_outputs", lambda *a: given.append(a[-1] is not None) or experts(*a))
    got = run()
    assert set(kept) == {True, ("combine", False) if fused_combine else False} and set(given) == {True}
    for g, w in zip(got, want):
        cos = (g * w).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(w, axis=-1)
        assert cos.min() >= 0.999, cos
        np.testing.assert_allclose(g, w, rtol=0.05, atol=0.05 * np.abs(w).max())


def test_fp8_checkpoint_load_quantizes_experts_layer_by_layer(ckpts):
    from jaxllm.fp8 import Fp8Matrix, quantize_out_in

    path, _ = ckpts["topk2_norm_dense_layer"]
    q = load_model(path, dtype="fp8").params["experts"]["gate_up"]
    want = quantize_out_in(load_model(path, dtype="bfloat16").params["experts"]["gate_up"])
    assert isinstance(q, Fp8Matrix)
    np.testing.assert_array_equal(np.asarray(q.weight, np.float32), np.asarray(want.weight, np.float32))
    np.testing.assert_allclose(np.asarray(q.scale), np.asarray(want.scale), rtol=1e-6)


def test_a_model_too_large_for_the_device_fails_before_loading():
    """The estimate (config x dtype) against the device's memory: one line with the ways out, nothing loaded."""
    from jaxllm.memory import ModelTooLargeError, check_fits, weight_bytes

    class H100:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

        def memory_stats(self):
            return {"bytes_limit": 79 << 30}

    config = PRESETS["qwen3-30b-a3b"]
    assert 56 << 30 < weight_bytes(config, jnp.bfloat16) < 58 << 30  # the published 61.1 GB
    assert weight_bytes(config, "fp8") < 30 << 30
    check_fits(config, jnp.bfloat16, H100())  # fits, with ~16 GiB to spare
    check_fits(config, "fp8", H100())
    with pytest.raises(ModelTooLargeError) as info:
        check_fits(config, jnp.float32, H100())
    message = str(info.value)
    assert "\n" not in message and "fp8" in message and "79.0 GiB" in message


def test_a_model_too_large_for_this_machine_fails_on_a_cpu(monkeypatch):
    """On a CPU the limit is the machine's memory (RAM, or the container's limit): the 30B says so in one line
    with the ways out that apply there (a GPU, a smaller preset; fp8 only where it would fit)."""
    from jaxllm import memory
    from jaxllm.memory import ModelTooLargeError, check_fits, host_memory_bytes

    assert host_memory_bytes() > 1 << 30  # this machine's, read from the OS

    class Cpu:
        platform, device_kind = "cpu", "cpu"

    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 24 << 30)
    check_fits(PRESETS["tiny-moe"], jnp.float32, Cpu())
    check_fits(PRESETS["qwen3-4b"], jnp.bfloat16, Cpu())  # 7.5 GiB + 6
    with pytest.raises(ModelTooLargeError) as info:
        check_fits(PRESETS["qwen3-30b-a3b"], jnp.float32, Cpu())
    message = str(info.value)
    assert "\n" not in message and "24.0 GiB of memory (running on the CPU)" in message
    assert "tiny-moe" in message and "56.9 GiB in bf16" in message and "--llm-dtype fp8" not in message
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 40 << 30)
    with pytest.raises(ModelTooLargeError, match="--llm-dtype fp8"):  # 29.1 GiB + 6 fits 40
        check_fits(PRESETS["qwen3-30b-a3b"], jnp.bfloat16, Cpu())


def test_load_model_checks_the_dtype_it_will_load(monkeypatch):
    """dtype None (rl.train's --llm-dtype auto) is checked as the dtype load_model resolves it to (bfloat16 on a
    GPU), not as float32: the bf16 30B fits a 70 GiB allocator, its float32 copy does not."""
    from jaxllm import api, memory
    from jaxllm.memory import ModelTooLargeError

    class Loading(Exception):
        pass

    def loading(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: 70 << 30)
    monkeypatch.setattr(api, "default_dtype", lambda: jnp.bfloat16)
    monkeypatch.setattr(api, "init_params", loading)
    with pytest.raises(Loading):  # the check passed
        load_model("qwen3-30b-a3b")
    with pytest.raises(ModelTooLargeError):
        load_model("qwen3-30b-a3b", dtype="float32")


def test_rl_train_says_in_one_line_that_the_model_does_not_fit(monkeypatch, tmp_path, capsys):
    """The trainer's user sees the memory check as one line (no traceback), before anything compiles for the model
    (the check runs on the shapes the programs compile from), and no run directory is left."""
    from jaxllm import memory
    from rl.train import main

    monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: 8 << 30)  # an 8 GiB card
    run_dir = tmp_path / "run"
    rc = main(["--encoder=inscan", "--preset", "test", "--model", "qwen3-30b-a3b", "--run-dir", str(run_dir)])
    out, err = capsys.readouterr()
    assert rc != 0 and "Traceback" not in err and "compiling" not in out + err
    line = next(ln for ln in err.splitlines() if "needs" in ln and "GiB" in ln)
    assert "fp8" in line and "30.5B parameters" in line
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Hopper grouped GEMM needs a GPU")
def test_mgpu_grouped_matmul_equals_ragged_dot_on_gpu():
    rng = np.random.default_rng(5)
    for k, n in ((256, 512), (128, 256)):
        sizes = np.bincount(rng.integers(0, 8, 700), minlength=8)
        sizes[2] = 0  # an empty group
        x = jnp.asarray(rng.normal(size=(int(sizes.sum()), k)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(8, n, k)) * 0.05, jnp.bfloat16)
        s = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(jax.jit(lambda a, b, c: moe.grouped_matmul(a, b, c, "mgpu"))(x, w, s), np.float32)
        want = np.asarray(moe.grouped_matmul(x, w, s, "ragged_dot"), np.float32)
        assert rel_err(got, want) < 1e-2

"""What XLA makes of one fp8 (W8A8) decoder layer: its kernels in order, which of them are cuBLASLt fp8 GEMMs, and
whether each activation quantisation (abs-max, divide, cast to e4m3) is fused with the op that produces it.

    python scripts/fp8_hlo_report.py                       # GPU: the Qwen3-4B layer shape, 8,192 tokens
    python scripts/fp8_hlo_report.py --smoke               # CPU: a small layer (XLA:CPU fuses differently)

It compiles `jaxllm.model.decoder_layer` alone (not under the layers' scan, so the kernels sit in the entry
computation) with the options the trainer uses for fp8 (`jaxllm.compile.compiler_options()`), then prints one
line per kernel: its kind, output, and the marker ops inside it (rsqrt = RMSNorm, logistic = SiLU, reduce,
convert to f8e4m3fn = a quantisation, the custom-call target). A quantisation fused with its producer shows as one
kernel holding both `rsqrt`/`logistic` and `->f8`; the abs-max reduce may sit in the producer's kernel or just before.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MARKERS = {"rsqrt": "rsqrt", "logistic": "silu", "exponential": "exp", "reduce(": "reduce", "f8e4m3fn[": "->f8",
           "dot(": "dot", "divide(": "div"}


def computations(hlo: str) -> dict[str, str]:
    """Computation name -> its body text, from an HLO module's text."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(1), []
            if line.startswith("ENTRY"):
                name = "ENTRY"
            continue
        if line.startswith("}") and name is not None:
            out[name] = "\n".join(lines)
            name = None
            continue
        if name is not None:
            lines.append(line)
    return out


def kernels(hlo: str) -> list[dict]:
    """The entry computation's kernels (fusions and custom calls) in order, with their marker ops."""
    comps = computations(hlo)
    rows = []
    for line in comps.get("ENTRY", "").splitlines():
        m = re.match(r"\s*%?([\w.\-]+) = (\(.*?\)|\S+) (fusion|custom-call)\(", line)
        if not m:
            continue
        name, shape, op = m.groups()
        body = ""
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            body = comps.get(called.group(1), "")
        target = re.search(r'custom_call_target="([^"]+)"', line)
        marks = sorted({label for key, label in MARKERS.items() if key in body})
        if "f8e4m3fn[" in shape:
            marks.append("out:f8")
        rows.append(dict(name=name, op=op, out=shape, target=target.group(1) if target else None, marks=marks))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a small layer, for a CPU check")
    p.add_argument("--tokens", type=int, default=None, help="tokens in the layer's input (default 8192; smoke 64)")
    p.add_argument("--out", type=Path, default=None, help="also write the kernel list as JSON here")
    p.add_argument("--hlo", type=Path, default=None, help="also write the optimised HLO text here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxllm import PRESETS, Qwen3Config, init_params
    from jaxllm.compile import compiler_options, jit
    from jaxllm.fp8 import quantize_params
    from jaxllm.layer_ops import norm_input
    from jaxllm.model import decoder_layer, rope_cos_sin

    config = (Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=1,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32) if args.smoke
              else PRESETS["qwen3-4b"])
    config = dataclasses.replace(config, num_hidden_layers=1)
    tokens = args.tokens or (64 if args.smoke else 8192)
    params = quantize_params(init_params(config, jnp.bfloat16, 0))
    layer = jax.tree.map(lambda a: a[0], params["layers"])
    h = jax.random.normal(jax.random.key(1), (1, tokens, config.hidden_size), jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.arange(tokens), config.head_dim, config.rope_theta, jnp.bfloat16)
    x = lambda h, lp: norm_input(h, lp["input_layernorm"], config.rms_norm_eps, quantized=True)
    fn = jit(lambda h, lp: decoder_layer(h, x(h, lp), lp, lp, lp["input_layernorm"], cos, sin, config)[:2],
             compiler_options=compiler_options())
    t0 = time.perf_counter()
    hlo = fn.lower(h, layer).compile().as_text()
    seconds = time.perf_counter() - t0
    rows = kernels(hlo)
    print(f"device {jax.devices()[0].device_kind}: one fp8 decoder layer, {tokens} tokens, compiled in "
          f"{seconds:.1f} s, {len(rows)} kernels, options {compiler_options()}")
    for i, r in enumerate(rows):
        what = r["target"] or ",".join(r["marks"]) or "-"
        print(f"{i:3d} {r['op']:11s} {r['out'][:40]:40s} {what}")
    gemms = [r for r in rows if r["target"] and "f8" in r["target"]]
    quant = [r for r in rows if "out:f8" in r["marks"]]
    print(f"cuBLASLt fp8 GEMMs: {len(gemms)}; kernels writing e4m3 activations: {len(quant)} "
          f"({', '.join(','.join(m for m in r['marks'] if m != 'out:f8') or '-' for r in quant)})")
    if args.out:
        args.out.write_text(json.dumps(dict(device=jax.devices()[0].device_kind, tokens=tokens,
                                            compile_s=seconds, kernels=rows), indent=2))
    if args.hlo:
        args.hlo.write_text(hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main())

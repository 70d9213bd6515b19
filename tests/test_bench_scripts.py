"""The GPU benchmark scripts run end to end at tiny shapes on CPU (`--smoke`), so they do not first break on a
GPU machine. Their numbers are not checked here (speed is measured by the scripts, never by tests); their
output structure is."""
import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def test_bench_train_smoke(tmp_path):
    import bench_train

    out = tmp_path / "train.json"
    bench_train.main(["--smoke", "--only", "none-128", "inscan-128-k8", "--updates", "1", "--out", str(out),
                      "--profile", str(tmp_path / "traces")])
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none-128", "inscan-128-k8"}
    assert all(r["sps"] > 0 and r["devices"] == 1 for r in rows.values())
    assert rows["inscan-128-k8"]["llm_prompts_per_s"] > 0 and "ratio_to_bound" in rows["inscan-128-k8"]
    assert all(r["no_window_update_s"] > 0 for r in rows.values())  # the traced update (no GPU plane on a CPU)


def test_gpu_stage_scripts_name_dtypes_bench_encoder_takes():
    """Every literal `--dtypes` value in scripts/gpu_*.sh (and every `--variants` value bench_ratio passes on,
    a default in `${VARIANTS:-...}` included) is one bench_encoder takes (a renamed variant would otherwise fail
    only on the GPU machine, after its start-up)."""
    import re

    import bench_encoder

    named = set()
    for script in (ROOT / "scripts").glob("gpu_*.sh"):
        text = script.read_text().replace("\\\n", " ")  # continued lines joined
        text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)  # a variable's default, as its words
        for match in re.finditer(r"--(?:dtypes|variants)((?:[ \t]+[^\s-]\S*)+)", text):
            named |= {v for v in match.group(1).split() if not v.startswith(("$", '"$'))}
    assert {"fp8", "fp8-moe-swiglu-kernel", "fp8-moe-epi64"} <= named
    for value in sorted(named):
        try:
            bench_encoder.parse_args(["--ragged", "--dtypes", value])
        except SystemExit:
            pytest.fail(f"a gpu_*.sh stage passes --dtypes {value}, which bench_encoder refuses")


def test_bench_encoder_counts_the_passes_the_encoder_plans():
    import bench_encoder

    # 282-token prompts behind Craftax's max_len 1,138: 116 fill the 32,768-token pass, the rest goes to a last pass
    assert bench_encoder.packed_passes([282] * 128, 32768, 1138) == [32768, 4096]  # 3,384 left
    assert bench_encoder.packed_passes([282] * 132, 32768, 1138) == [32768, 8192]  # 4,512 left
    six = bench_encoder.six_pass_sizes(32768, 1138)
    assert six == (4096, 6144, 8192, 12288, 16384, 32768)  # the sizes of before
    assert bench_encoder.packed_passes([282] * 132, 32768, 1138, sizes=six) == [32768, 6144]
    # 16,638 left: the default fills two passes of 8,192 and ends with 4,096; the six sizes of before one of 32,768
    assert bench_encoder.packed_passes([282] * 175, 32768, 1138) == [32768, 8192, 8192, 4096]
    assert bench_encoder.packed_passes([282] * 175, 32768, 1138, sizes=six) == [32768, 32768]
    assert bench_encoder.packed_passes([0, 5, 0], 24, 12) == [12]
    # at the default capacity (36,864) 128 such prompts are one pass; 136 (a trainer window) one only if shorter
    assert bench_encoder.packed_passes([282] * 128, 36864, 1138) == [36864]
    assert bench_encoder.packed_passes([282] * 136, 36864, 1138) == [36864, 4608]
    assert bench_encoder.packed_passes([270] * 136, 36864, 1138) == [36864]


def test_bench_encoder_ragged_moe_rows_smoke():
    """--ragged on the tiny MoE: the variant rows that put the router's top-k back on lax.top_k, the combine inside
    the residual kernel and the fp8 experts' SwiGLU in its own kernel after the GEMM (on a CPU they name paths the GPU
    takes and must run), and the one-pass packing (the smallest 1,024-multiple row that holds every real token)."""
    import bench_encoder

    variants = ["fp8-moe-xla-topk", "fp8-moe-fused-combine", "fp8-moe-swiglu-kernel"]
    res = bench_encoder.main(["--ragged", "--smoke", "--model", "qwen3-30b-a3b", "--dtypes", *variants,
                              "--methods", "packed", "packed-one-pass", "--iters", "1", "--no-hf",
                              "--no-gemm-ceiling"])
    rows = {(r["dtype"], r["method"]): r for r in res["ragged"]["rows"]}
    assert len(rows) == 6 and all("error" not in r and r["finite"] and r["ms"] > 0 for r in rows.values()), rows
    # 1,229 real tokens: the default plan (capacity 4,608: sizes 1,152 and 4,608) fills a 1,152-token pass and puts
    # the rest in another; one pass is the 2,048 that holds them
    for dtype in variants:
        assert rows[dtype, "packed"]["passes"] == [1152, 1152] and rows[dtype, "packed-one-pass"]["passes"] == [2048]
        assert rows[dtype, "packed-one-pass"]["real_tokens"] == 1229


def test_bench_ratio_smoke(tmp_path):
    """Both models' stand-ins (and the first with a variant's settings) compiled once in one process, timed in
    rounds whose order alternates: one time per row per round, each first-model row's ratio the median of the
    rounds' ratios to the second model (its prompts/s over the second's); a variant of another dtype, or one model
    named twice, is refused."""
    import bench_ratio

    variant = "fp8-moe-silu-exp"
    res = bench_ratio.main(["--smoke", "--rounds", "3", "--iters", "1", "--variants", variant,
                            "--out", str(tmp_path / "r.json")])
    ms = res["ms"]
    rows = ["qwen3-30b-a3b", f"qwen3-30b-a3b {variant}", "qwen3-4b"]
    assert list(ms) == rows and all(len(v) == 3 and min(v) > 0 for v in ms.values())
    for row in rows[:2]:
        ratios = sorted(b / a for a, b in zip(ms[row], ms["qwen3-4b"]))
        assert res["ratios"][row]["median"] == pytest.approx(ratios[1])
        assert res["ratios"][row]["min"] == pytest.approx(ratios[0])
    assert res["ratio"] == res["ratios"][rows[0]]["median"] and "qwen3-4b" not in res["ratios"]
    assert json.loads((tmp_path / "r.json").read_text())["ratio"] == pytest.approx(res["ratio"])
    # each row's timings as wall-clock windows (scripts/gpu_clocks.py reads the card's clocks in them), one a
    # round, none overlapping another
    spans = sorted(span for row in rows for span in res["timed_windows"][row])
    assert [len(res["timed_windows"][row]) for row in rows] == [3, 3, 3]
    assert all(start < end <= later for (start, end), (later, _) in zip(spans, spans[1:] + [(math.inf, 0)]))
    # --variants-on both: the second model with the variant too, and the variant's ratio between the two of them
    both = bench_ratio.main(["--smoke", "--rounds", "2", "--iters", "1", "--variants", "fp8-xla-merge",
                             "--variants-on", "both"])
    pair = ["qwen3-30b-a3b fp8-xla-merge", "qwen3-4b fp8-xla-merge"]
    assert set(both["ms"]) == {"qwen3-30b-a3b", "qwen3-4b", *pair}
    assert both["ratios"][pair[0]]["against"] == pair[1] and both["ratios"]["qwen3-30b-a3b"]["against"] == "qwen3-4b"
    assert both["ratios"][pair[0]]["max"] == pytest.approx(max(b / a for a, b in zip(*(both["ms"][r] for r in pair))))
    with pytest.raises(SystemExit):
        bench_ratio.parse_args(["--dtype", "bfloat16", "--variants", variant])
    with pytest.raises(SystemExit):
        bench_ratio.parse_args(["--models", "qwen3-4b", "qwen3-4b"])


def test_gpu_clocks_reads_samples_and_summarises_each_rows_windows():
    """nvidia-smi's CSV lines become samples (a cut-off last line skipped); each row's summary takes only the samples
    inside its windows: clock mean and low, power mean and high, the throttle reasons any of them had, by name."""
    import gpu_clocks

    lines = ["2026/11/30 06:20:48.000, 1980, 300.5, 40, 0x0000000000000000",
             "2026/11/30 06:20:48.100, 1700, 690.0, 55, 0x0000000000000004",
             "2026/11/30 06:20:48.200, 1500, 705.0, 58, 0x0000000000000024",
             "2026/11/30 06:20:48.300, 1980, 120.0, 41, 0x0000000000000001",
             "2026/11/30 06:20:48.4"]
    samples = gpu_clocks.parse_samples(lines)
    assert [s.sm_mhz for s in samples] == [1980, 1700, 1500, 1980] and samples[2].reasons == 0x24
    t = samples[1].time
    summary = gpu_clocks.summarise(samples, {"busy": [[t - 0.01, t + 0.11]], "idle": [[t + 0.15, t + 0.25]],
                                             "never": [[t + 10, t + 11]]})
    busy = summary["busy"]
    assert busy["samples"] == 2 and busy["sm_mhz_mean"] == 1600 and busy["sm_mhz_min"] == 1500
    assert busy["power_w_mean"] == pytest.approx(697.5) and busy["power_w_max"] == 705 and busy["temperature_c_max"] == 58
    assert busy["throttle_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert summary["idle"]["throttle_reasons"] == ["gpu_idle"] and summary["never"] == {"samples": 0}
    assert gpu_clocks.throttle_names(0x1004) == ["sw_power_cap", "0x1000"]


def test_gpu_clocks_runs_a_benchmark_under_the_sampler(tmp_path, monkeypatch):
    """End to end with a stand-in nvidia-smi on PATH (it writes two samples a loop until stopped): the command runs,
    the sampler is stopped, and its samples inside the windows of the command's --out result are summarised;
    a command without --out, or whose result has no windows, is refused in one line."""
    import gpu_clocks

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env python3\n"
                    "import datetime, sys, time\n"
                    "out = open(sys.argv[sys.argv.index('-f') + 1], 'a')\n"
                    "while True:\n"
                    "    now = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
                    "    out.write(f'{now}, 1650, 640.0, 57, 0x0000000000000004\\n'); out.flush(); time.sleep(0.02)\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    result = tmp_path / "r.json"
    bench = ("import json, sys, time; s = time.time(); time.sleep(0.5); "
             "json.dump({'timed_windows': {'row': [[s, time.time()]]}}, open(sys.argv[2], 'w'))")
    summary = gpu_clocks.main(["--out", str(tmp_path / "clocks"), "--", sys.executable, "-c", bench, "--out",
                               str(result)])
    assert summary["row"]["samples"] >= 3 and summary["row"]["sm_mhz_mean"] == 1650
    assert summary["row"]["throttle_reasons"] == ["sw_power_cap"]
    assert json.loads((tmp_path / "clocks" / "clocks_summary.json").read_text()) == summary
    with pytest.raises(SystemExit, match="must write its result with --out"):
        gpu_clocks.main(["--out", str(tmp_path / "c2"), "--", sys.executable, "-c", "pass"])
    with pytest.raises(SystemExit, match="has no timed_windows"):
        gpu_clocks.main(["--out", str(tmp_path / "c3"), "--", sys.executable, "-c",
                         "import json, sys; json.dump({}, open(sys.argv[2], 'w'))", "--out", str(result)])


def test_bench_template_smoke(tmp_path):
    import bench_template

    res = bench_template.main(["--smoke", "--envs", "Craftax-Classic-Symbolic-v1", "--formats", "compact",
                               "--added-measure", "--hlo-dir", str(tmp_path / "hlo"), "--out", str(tmp_path / "t.json")])
    env = res["envs"]["Craftax-Classic-Symbolic-v1"]
    assert env["env_step_in_loop_s"] > 0 and env["loop_overhead_s"] > 0
    assert env["informative_tiles"]["max"] > 0
    r = env["formats"]["compact"]
    assert r["template_in_loop_s"] > 0 and r["kernels"] > 0
    assert r["env_step_with_template_in_loop_s"] > 0 and "ratio_added" in r and "ratio_in_loop_net" in r
    assert "ENTRY" in (tmp_path / "hlo" / "Craftax-Classic-Symbolic-v1_compact.hlo.txt").read_text()
    assert 0 < r["tokens"]["mean"] <= r["tokens"]["max"] <= r["tokens"]["max_len"]


@pytest.mark.slow
def test_bench_reference_smoke(tmp_path):
    """Our half always; the upstream half only where a Craftax_Baselines checkout is named by
    CRAFTAX_BASELINES_DIR (CI has none: the upstream code is never part of this repository)."""
    import bench_reference

    ref = os.environ.get("CRAFTAX_BASELINES_DIR")
    out = tmp_path / "ref.json"
    flags = ["--reference-dir", ref] if ref else ["--skip-reference"]
    bench_reference.main(["--smoke", "--only", "none-1024", "--updates", "1", "--repeats", "1", "--out", str(out),
                          "--rl-train", "--train-updates", "3", "--train-skip", "1", "--train-dir", str(tmp_path / "runs"),
                          "--variants", "lazy@none-1024=--lazy-reset true", "never@none-128-autoreset=--env-unroll 2",
                          "--compile-threads", "2", *flags])
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["config"] == "none-1024" and row["num_envs"] == 8
    assert row["ours_sps_dispatch"] > 0 and row["ours_sps_host_loop"] > 0 and row["ours_first_update_s"] > 0
    # rl.train itself: the default and the one variant that applies to this config, from their own records
    assert set(row["rl_train"]) == {"default", "lazy"} and row["rl_train_sps"] == row["rl_train"]["default"]["sps"]
    for res in row["rl_train"].values():
        assert res["rc"] == 0 and res["updates"] == 2 and res["sps"] > 0 and len(res["seconds_all"]) == 2
    assert row["rl_train"]["lazy"]["ratio_to_default"] > 0
    assert set(result["rl_train_warmup"]) == {"none-1024.default", "none-1024.lazy"}
    assert "--lazy-reset" in result["rl_train_commands"]["none-1024.lazy"]
    if ref:
        assert row["reference_sps"] > 0 and row["ratio_dispatch"] > 0 and row["ratio_rl_train"] > 0
    with pytest.raises(SystemExit, match="git clone"):
        bench_reference.main(["--smoke", "--reference-dir", str(tmp_path / "nowhere")])


def test_rl_train_records_give_the_steady_state_and_variants_parse():
    """The median over the records after the warm-up (the compiling first record never counts); variants with and
    without a config filter."""
    import rl_train_runs

    recs = [dict(update=1, sps=10.0, seconds=100.0, first_call_includes_compile=True)] + [
        dict(update=u, sps=1000.0 / s, seconds=s) for u, s in ((2, 0.5), (3, 1.0), (4, 1.0), (5, 2.0))]
    res = rl_train_runs.steady_state(recs, skip=2)
    assert res["updates"] == 3 and res["seconds"] == 1.0 and res["sps"] == 1000.0
    assert res["sps_total"] == 3000.0 / 4.0 and res["seconds_all"] == [1.0, 1.0, 2.0]
    assert rl_train_runs.steady_state(recs[:2], skip=5)["updates"] == 1  # too few: every record after the first
    assert rl_train_runs.steady_state(recs[:1], skip=0) == dict(updates=0)
    default, lazy, both = rl_train_runs.parse_variants(["lazy@a,b=--lazy-reset true", "both=--x 1 --y=2"])
    assert default.name == "default" and default.flags == () and default.applies_to("anything")
    assert lazy.flags == ("--lazy-reset", "true") and lazy.applies_to("b") and not lazy.applies_to("c")
    assert both.flags == ("--x", "1", "--y=2") and both.applies_to("c")
    with pytest.raises(ValueError, match="NAME"):
        rl_train_runs.parse_variants(["--lazy-reset true"])


def test_bench_label_smoke(tmp_path):
    import bench_label

    res = bench_label.main(["--smoke", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "label.json")])
    assert res["record"]["files"] == 3 and res["label"]["samples"] == 96 and res["label"]["samples_per_s"] > 0
    assert res["encoder"]["prompts"] == 32 and res["encoder"]["tokens_mean"] > 0
    assert res["ratio_end_to_end_to_encoder"] > 0
    assert json.loads((tmp_path / "label.json").read_text())["label"]["files"] == 3


def test_bench_record_smoke(tmp_path):
    import bench_record

    res = bench_record.main(["--smoke", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "record.json")])
    assert res["without"]["sps"] > 0 and res["with"]["sps"] > 0 and res["ratio_with_to_without"] > 0
    assert res["with"]["files"] == 5  # 3 updates of 64 samples (the compiling one included), 40 per file


def test_bench_offline_smoke(tmp_path):
    import bench_offline

    res = bench_offline.main(["--smoke", "--out", str(tmp_path / "offline.json")])
    assert res["updates"] == 200 and res["seconds"] > 0 and res["updates_per_s"] > 0
    assert math.isfinite(res["final_loss"]) and res["bytes_per_sample"] > 0
    assert json.loads((tmp_path / "offline.json").read_text())["samples"] == res["samples"]


def test_bench_layer_kernels_smoke(tmp_path):
    import bench_layer_kernels

    out = tmp_path / "kernels.json"
    rows = bench_layer_kernels.main(["--smoke", "--out", str(out)])
    assert [(r["kernel"], r["setting"]) for r in rows] == [
        ("residual_norm_quantize", "xla"), ("residual_norm_quantize", "2:4:64"), ("head_norm_rope (q)", "xla"),
        ("head_norm_rope (q)", "8:4"), ("head_norm_rope (k)", "xla"), ("head_norm_rope (k)", "8:4"),
        ("merge_quantize", "xla+kernel"), ("merge_quantize", "4:2")]
    assert all(r["ms"] > 0 for r in rows) and json.loads(out.read_text())["tokens"] == 40
    only = bench_layer_kernels.main(["--smoke", "--sections", "merge"])
    assert [r["kernel"] for r in only] == ["merge_quantize"] * 2


def test_bench_moe_smoke(tmp_path):
    """The grouped-GEMM candidates (CPU: ragged_dot, padded) checked against per-group products, and the block;
    with --rounds, each row timed again in alternating rounds and set against the best dense time of the same
    round."""
    from scripts import bench_moe

    res = bench_moe.main(["--smoke", "--rounds", "3", "--out", str(tmp_path / "moe.json")])
    rows = [r for r in res["results"] if r["candidate"] == "ragged_dot"]
    assert rows and all(r["max_rel_err"] < 1e-5 for r in rows)
    for r in rows:  # --rounds: each row timed 3 times, against the best dense row of its shape in each round
        dense = [d["round_ms"] for d in res["results"] if d["candidate"].startswith("dense") and d["shape"] == r["shape"]]
        assert len(dense) == 2 and len(r["round_ms"]) == 3 and r["round_ms"][0] == r["ms"] and r["median_ms"] > 0
        best = [min(times) for times in zip(*dense)]
        assert r["of_dense_rounds"] == [round(d / m, 4) for d, m in zip(best, r["round_ms"])]
    assert res["moe_block"]["ms"] > 0 and (tmp_path / "moe.json").is_file()


def test_bench_moe_fp8_smoke():
    """--fp8: e4m3 operands; ragged_dot's products of them equal the float32 per-group products exactly; the fp8
    dense GEMM and the block with e4m3 experts run; candidates that take no e4m3 operands are skipped. With
    --movement, the block's memory-bound steps run in each of their forms."""
    from scripts import bench_moe

    res = bench_moe.main(["--smoke", "--fp8", "--movement"])
    assert res["operands"] == "float8_e4m3fn"
    # --movement: every gather and every scale + SwiGLU kernel ran and equals the first (XLA's) bit for bit
    steps = {(r["step"], r["candidate"]): r for r in res["movement"]}
    assert len(steps) == 2 * 13 + 5 + 2 * 7 and all("error" not in r for r in steps.values()), steps
    assert all(r["equal_to_first"] for r in steps.values() if "equal_to_first" in r)
    assert all(r["values_changed"] == 0.0 for r in steps.values() if "values_changed" in r)
    assert all(r["max_abs_diff_over_max"] == 0.0 for r in steps.values() if "max_abs_diff_over_max" in r)
    assert {r["candidate"] for r in res["results"]} == {"dense", "dense_xla_defaults", "ragged_dot"}
    assert all(r["max_rel_err"] == 0.0 for r in res["results"] if r["candidate"] == "ragged_dot")
    assert res["moe_block"]["ms"] > 0


def test_moe_routing_report_smoke():
    """float32 against itself flips nothing; the report's fields are there for bfloat16."""
    from scripts import moe_routing_report

    res = moe_routing_report.main(["--prompts", "2", "--dtypes", "float32", "bfloat16"])
    assert res["dtypes"]["float32"]["token_layer_set_flip_rate"] == 0.0
    assert res["dtypes"]["float32"]["cosine_to_reference"]["min"] > 0.99999
    assert 0.0 <= res["dtypes"]["bfloat16"]["slot_flip_rate"] <= 1.0


def test_spread_routing_variant_evens_the_load_of_identical_tokens():
    """bench_encoder's `*-moe-spread-routing`: tokens that all choose the same experts (as the random 30B's do)
    come out spread evenly, each still with top_k distinct experts and the weights it had."""
    import jax.numpy as jnp
    import numpy as np

    import bench_encoder
    from jaxllm import moe

    [(module, name, spread_route)] = bench_encoder.variant_patches("fp8-moe-spread-routing")
    assert (module, name) == (moe, "route")
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.repeat(rng.normal(size=(1, 64)), 256, axis=0), jnp.float32)
    router = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    weights, experts = moe.route(x, router, 4, True)
    assert len(np.unique(np.asarray(experts), axis=0)) == 1
    spread_weights, spread = spread_route(x, router, 4, True)
    np.testing.assert_array_equal(spread_weights, weights)
    spread = np.asarray(spread)
    assert all(len(set(row)) == 4 for row in spread)
    assert np.all(np.bincount(spread.reshape(-1), minlength=32) == 256 * 4 // 32)


def test_scattered_routing_variant_spreads_the_load_unevenly():
    """bench_encoder's `*-moe-scattered-routing`: identical tokens come out on every expert, each token with top_k
    distinct experts and its weights, the load uneven (so tiles are part padding) but near the mean, as a trained
    router's spread load would be."""
    import jax.numpy as jnp
    import numpy as np

    import bench_encoder
    from jaxllm import grouped_gemm, moe

    [(module, name, scattered_route)] = bench_encoder.variant_patches("fp8-moe-scattered-routing")
    assert (module, name) == (moe, "route")
    rng = np.random.default_rng(1)
    tokens, experts_n, top_k = 4096, 32, 4
    x = jnp.asarray(np.repeat(rng.normal(size=(1, 64)), tokens, axis=0), jnp.float32)
    router = jnp.asarray(rng.normal(size=(64, experts_n)), jnp.float32)
    weights, _ = moe.route(x, router, top_k, True)
    scattered_weights, scattered = scattered_route(x, router, top_k, True)
    np.testing.assert_array_equal(scattered_weights, weights)
    scattered = np.asarray(scattered)
    assert all(len(set(row)) == top_k for row in scattered)
    load = np.bincount(scattered.reshape(-1), minlength=experts_n)
    assert load.min() > 0 and load.max() / load.mean() < 1.3
    padded = grouped_gemm.padded_row_count(tokens * top_k, experts_n, 128)
    assert np.sum(-load % 128) > 0 and padded >= tokens * top_k + np.sum(-load % 128)


def test_moe_fp8_hidden_error_smoke():
    """Both hidden forms at a small shape: errors of e4m3's size (a few %), and 128-wide blocks no coarser than one
    scale per row (each block's largest value is exact, and there are F / 128 of them per row)."""
    from scripts import moe_fp8_hidden_error

    res = moe_fp8_hidden_error.main(["--hidden", "64", "--ffn", "256", "--experts", "8", "--top-k", "2",
                                     "--tokens", "128"])
    rows, blocks = res["forms"]["rows"], res["forms"]["blocks"]
    assert all(0.005 < form[key] < 0.1 for form in (rows, blocks) for key in form)
    assert blocks["hidden"] <= rows["hidden"]


def test_hlo_fusions_finds_a_compiled_fusion_and_its_body(tmp_path, capsys):
    """scripts/hlo_fusions.py on a CPU program's optimised HLO written where an XLA dump would put it: the
    fusion's line (its shape) and the elementwise steps of the computation it calls."""
    import re

    import hlo_fusions
    import jax
    import jax.numpy as jnp

    text = jax.jit(lambda x: (x * 2 + 1).astype(jnp.bfloat16)).lower(jnp.ones((64, 128))).compile().as_text()
    name = re.search(r"%(\w*fusion[\w.]*) = bf16\[64,128\]", text).group(1)
    (tmp_path / "module_0001.jit_f.cpu_after_optimizations.txt").write_text(text)
    (tmp_path / "module_0001.jit_f.before_optimizations.txt").write_text(text)  # not read: no report of it
    hlo_fusions.main([str(tmp_path), name, "no_such_fusion"])
    out = capsys.readouterr().out
    assert out.count("== ") == 1 and f"-- {name}" in out and "no_such_fusion" not in out
    assert f"%{name} = bf16[64,128]" in out and "multiply(" in out and "convert(" in out
    # a profile spells instruction sort.34 as the kernels sort_34, sort_34_1, ...
    assert hlo_fusions.matches("sort.34", "sort_34_1") and hlo_fusions.matches("sort.34", "sort_34")
    assert not hlo_fusions.matches("sort.34", "sort_345") and not hlo_fusions.matches("fusion.2", "fusion_23")


def test_kernel_times_sums_a_line_its_idle_time_and_the_kernels_past_the_top():
    """scripts/kernel_times.line_summary on a made-up GPU line (the CPU has no GPU plane to trace): overlapping
    kernels count once towards the busy time, the gaps between them are the idle time, kinds from the names."""
    import kernel_times

    ms = 1e6  # ns
    events = [("body_mosaic_gpu_kernel", 0, 4 * ms), ("gather_rows__5", 5 * ms, 1 * ms),
              ("loop_convert_fusion", 5.5 * ms, 1 * ms),  # overlaps the gather by 0.5 ms
              ("body_mosaic_gpu_kernel", 10 * ms, 4 * ms), ("cudnn_sdpa_fprop", 16 * ms, 2 * ms)]
    s = kernel_times.line_summary(events, top=2)
    assert s["events"] == 5 and math.isclose(s["total_ms"], 12.0)
    assert math.isclose(s["span_ms"], 18.0) and math.isclose(s["idle_ms"], 18.0 - 11.5)
    assert s["by_kind_ms"] == {"gemm": 8.0, "attention": 2.0, "pallas": 1.0, "other": 1.0}
    assert [row["kernel"] for row in s["top"]] == ["body_mosaic_gpu_kernel", "cudnn_sdpa_fprop"]
    assert s["rest"] == {"kernels": 2, "calls": 2, "ms": 2.0}
    assert kernel_times.line_summary([], top=2)["idle_ms"] == 0.0
    # a kernel inside a longer one (another stream's event on the same line): the span ends with the longer one
    nested = kernel_times.line_summary([("a", 0, 10 * ms), ("b", 2 * ms, 1 * ms)])
    assert math.isclose(nested["span_ms"], 10.0) and nested["idle_ms"] == 0.0


def test_every_bench_encoder_variant_changes_a_setting():
    """Each --dtypes variant bench_encoder offers patches at least one module attribute that exists, to a value other
    than its default (a renamed setting, or a default flipped to the variant's value, would leave a variant timing
    the defaults under another name)."""
    import bench_encoder

    for name in bench_encoder.VARIANTS:
        patches = bench_encoder.variant_patches(name)
        assert patches, name
        for module, attribute, _ in patches:
            assert hasattr(module, attribute), (name, attribute)
        assert any(getattr(module, attribute) is not value and getattr(module, attribute) != value
                   for module, attribute, value in patches), f"{name} sets only what the defaults already are"
    assert bench_encoder.variant_patches("fp8") == []
    with pytest.raises(ValueError, match="not in variant_patches' table"):
        bench_encoder.variant_patches("fp8-no-such-variant")


def test_bench_moe_routings_sum_to_the_rows():
    """bench_moe's group sizes: each routing's sizes sum to the rows; "same" fills top_k experts (the random 30B's
    routing), "even" all of them alike (a spread load)."""
    import numpy as np

    from scripts import bench_moe

    for kind, rows in (("uniform", 4096 * 8), ("skewed", 4096 * 8 + 3), ("one", 4096 * 8 + 3), ("same", 4096 * 8 + 3),
                       ("even", 4096 * 8 + 3)):
        sizes = np.asarray(bench_moe.group_sizes_for(kind, rows, 128, 8))
        assert sizes.sum() == rows and sizes.min() >= 0, kind
    same = np.asarray(bench_moe.group_sizes_for("same", 4096 * 8, 128, 8))
    assert np.count_nonzero(same) == 8 and same.max() == 4096
    assert np.all(np.asarray(bench_moe.group_sizes_for("even", 4096 * 8, 128, 8)) == 256)


def test_bench_moe_times_calls_back_to_back():
    """--back-to-back N: each timed iteration queues N calls and synchronises once; the time is per call."""
    import argparse

    from scripts import bench_moe

    calls = []
    seconds = bench_moe.time_per_call(lambda: calls.append(1) or len(calls),
                                      argparse.Namespace(back_to_back=3, iters=2))
    assert len(calls) == (2 + 2) * 3 and seconds >= 0  # 2 warm-up and 2 timed iterations of 3 calls
    args = bench_moe.parse_args(["--smoke", "--back-to-back", "4"])
    assert args.back_to_back == 4 and bench_moe.parse_args(["--smoke"]).back_to_back == 1


def test_bench_scale_forms_pieces_on_cpu():
    """bench_scale_forms: each block's scale is its abs-max / 448 (against numpy), its XLA dense row runs at small
    shapes, and without a CUDA GPU the script stops in one line saying so."""
    import bench_scale_forms
    import numpy as np
    import torch

    x = torch.randn(256, 384)
    for rows, cols in ((1, 128), (128, 128)):
        want = np.abs(x.numpy()).reshape(256 // rows, rows, 3, 128).max(axis=(1, 3)) / 448
        np.testing.assert_allclose(bench_scale_forms.block_amax_scales(x, rows, cols).numpy(), want, rtol=1e-6)
    args = bench_scale_forms.parse_args(["--rows", "2048", "--experts", "4", "--top-k", "2", "--k", "256",
                                         "--n", "256"])
    forms = bench_scale_forms.jax_forms(args)
    assert set(forms) == {"xla_dense_per_tensor", "ours_down_rows", "ours_down_blocks"}
    assert forms["xla_dense_per_tensor"]().shape == (2048, 256)
    gate_up = bench_scale_forms.parse_args(["--gemm", "gate_up"])
    assert (gate_up.k, gate_up.n) == (2048, 1536)  # Qwen3-30B-A3B's gate+up: D in, 2F out
    gate_up = bench_scale_forms.parse_args(["--gemm", "gate_up", "--rows", "2048", "--experts", "4", "--top-k", "2",
                                            "--k", "256", "--n", "512"])
    forms = bench_scale_forms.jax_forms(gate_up)
    assert set(forms) == {"xla_dense_per_tensor", "ours_gate_up"}
    assert forms["xla_dense_per_tensor"]().shape == (2048, 512)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench_scale_forms.main([])

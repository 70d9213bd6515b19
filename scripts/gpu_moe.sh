#!/usr/bin/env bash
# Qwen3-30B-A3B on one GPU, in stages that each fit one 10-minute device call (docs/BENCHMARKS.md "Qwen3-30B-A3B"):
#   bash scripts/gpu_moe.sh kernels OUT   # grouped-GEMM candidates vs dense, mgpu tiling sweep, the GPU kernel test
#   bash scripts/gpu_moe.sh encoder OUT   # packed encoder, 128 Craftax-Symbolic prompts: 30B-A3B vs 4B, bf16 + fp8
#   bash scripts/gpu_moe.sh check OUT     # the GPU kernel test, the sparse block alone, the 30B encoder (bf16)
#   bash scripts/gpu_moe.sh tiled OUT     # the tiled kernel: GPU test, vs mgpu and dense, its sweep, the block, encoders
#   bash scripts/gpu_moe.sh train OUT     # in-scan trainer, 128 envs, skip_n 8, 30B-A3B bf16 and fp8, cold
#   bash scripts/gpu_moe.sh recheck OUT   # after a change to the block: the block with its kernel profile, both
#                                         # bf16 encoders, the 30B bf16 trainer cold (4 updates), ~7 minutes
#   bash scripts/gpu_moe.sh h200 OUT      # on an H200 at JAX's default memory fraction (75%): both encoders in
#                                         # bf16 and fp8, the 30B bf16 trainer cold (4 updates), the GPU memory in
#                                         # use sampled every second (OUT/memory.csv: the peak of each step), ~9 min
#   bash scripts/gpu_moe.sh fp8 OUT       # W8A8 experts: the GPU kernel tests (bf16 and e4m3), then both encoders
#                                         # in bf16 and fp8 at the default memory fraction (the 30B's profiled), ~7 min
#   bash scripts/gpu_moe.sh fp8kernels OUT  # the e4m3 expert kernels vs a dense fp8 GEMM, their config sweep, the
#                                           # fp8 block with its kernel profile, ~5 min
#   bash scripts/gpu_moe.sh movement OUT  # the block's memory-bound steps: the GPU tests of the row gather and the
#                                         # fp8 scale + SwiGLU kernel, both alone against their XLA forms, the e4m3
#                                         # kernels vs dense fp8 with their sweep, the fp8 block profiled, the bf16
#                                         # kernels' sweep on this card, ~9 min
#   bash scripts/gpu_moe.sh rows OUT      # after a change to the row movement: the GPU tests, the movement steps and
#                                         # the fp8 block alone, both encoders in bf16 and fp8 (the 30B's profiled), ~9 min
#   bash scripts/gpu_moe.sh norms OUT     # the fp8 MoE layer's residual steps on the one-pass kernel: its GPU tests,
#                                         # the 30B encoder in fp8 with the kernel and with those steps in XLA (one
#                                         # process, both rows profiled), the 4B's fp8 encoder, ~8 min
#   bash scripts/gpu_moe.sh topk OUT      # the router's top-k kernel: its GPU test, the 30B encoder in fp8 with the
#                                         # kernel and with lax.top_k (one process, profiled), the 4B's fp8 encoder,
#                                         # the 30B fp8 trainer cold (5 updates), ~8 min
#   bash scripts/gpu_moe.sh ratio OUT     # the fp8 encoders' ratio: the 30B's, the 4B's, then the 30B's again with
#                                         # XLA's command buffers also over while loops and conditionals, ~7 min
#   bash scripts/gpu_moe.sh profiles OUT  # both fp8 encoders profiled in one call: where the 30B's extra time goes
#                                         # (GPU busy time per kernel, the time between kernels), each also packed
#                                         # in one pass of the same tokens instead of two (packed-one-pass), ~7 min
#   bash scripts/gpu_moe.sh swiglu OUT    # with gate+up's SwiGLU in the epilogue (the default): the fp8 GPU tests, the
#                                         # 30B's fp8 encoder as it runs, with the combine inside the residual kernel,
#                                         # and with the SwiGLU in its own kernel (one process, profiled), the 4B's
#                                         # fp8 encoder, the 30B fp8 trainer cold (4 updates), ~9.5 min
#   bash scripts/gpu_moe.sh epilogues OUT # down's scales in its epilogue and the gathered-block row gather: the fp8
#                                         # GPU tests, the movement steps' forms, the e4m3 kernels (epilogue forms
#                                         # first) with their sweep, the fp8 block, ~8 min
#   bash scripts/gpu_moe.sh downscales OUT  # the fp8 GPU tests of the epilogues and the gather, the fp8 encoders'
#                                         # ratio with down's scales in its epilogue (the default) and in the
#                                         # combine (one process, profiled), the 4B's fp8 encoder, ~8 min
#   bash scripts/gpu_moe.sh defaults OUT  # the defaults (token rows scattered, passes of up to 36,864 tokens): the
#                                         # 30B's encoder in fp8 and bf16, each also with the rows gathered (one
#                                         # process), the 4B's in fp8 and bf16, the 30B fp8 trainer cold, ~9 min
#   bash scripts/gpu_moe.sh capacity OUT  # both fp8 trainers cold (128 envs, skip_n 8, 5 updates) with passes of up
#                                         # to 36,864 tokens (the default) and of 32,768 (before), GPU memory, ~8 min
#   bash scripts/gpu_moe.sh pipelined OUT # down's GEMM with a CTA's tiles as one pipeline (the default): the GPU
#                                         # tests, the 30B's fp8 encoder with and without (one process), the 4B's
#                                         # fp8 encoder, ~6 min (bench_moe.py --pipeline-tiles 0 1: the kernels)
#   bash scripts/gpu_moe.sh rounds OUT    # the encoders' ratio, both models in one process in alternating rounds
#                                         # (scripts/bench_ratio.py): fp8, then bf16, ~9 min
#   bash scripts/gpu_moe.sh candidates OUT  # the GPU tests of the SiLU forms and epilogue pieces, then the 30B's
#                                         # fp8 encoder as it is and with bench_encoder variants (VARIANTS, default:
#                                         # the SiLU by expf, 64-row pieces) against the 4B's (bench_ratio rounds,
#                                         # one process), ~6 min
#   bash scripts/gpu_moe.sh silu OUT      # gate+up's SiLU by ex2.approx (the default) vs expf: the GPU tests, the
#                                         # gate+up kernels both ways (fp8, bf16), the 30B's fp8 encoder both ways
#                                         # (one process), the 4B's, ~9.5 min
#   bash scripts/gpu_moe.sh breakdown OUT # both fp8 encoders profiled, every kernel listed (OUT/*.log), and the
#                                         # 30B's compiled HLO (OUT/hlo.tar.gz: which ops each fusion holds), ~6 min
#   bash scripts/gpu_moe.sh merge OUT     # packed attention's halves merged inside o_proj's quantisation (the
#                                         # default) and the dispatch's group starts: the GPU tests, the merge
#                                         # kernels alone (its settings against XLA's merge + the quantisation
#                                         # kernel), then both fp8 encoders with it and without (VARIANTS;
#                                         # bench_ratio rounds), ~7 min
#   bash scripts/gpu_moe.sh confirm OUT   # the routing's GPU tests, the fp8 encoders' ratio (bench_ratio, 4
#                                         # rounds), then the 30B fp8 trainer cold (128 envs, skip_n 8, 3 updates),
#                                         # ~7 min
#   bash scripts/gpu_moe.sh confirm16 OUT # as confirm in bf16: the encoders' ratio (3 rounds), the 30B bf16 trainer
#                                         # cold (3 updates), ~7 min
#   bash scripts/gpu_moe.sh routing OUT   # the router's softmax, top-k and renormalisation as one kernel
#                                         # (moe.FUSED_ROUTER) and the dispatch's pair sort (moe.PAIR_SORT), both
#                                         # on: their GPU tests, then the 30B's fp8 encoder without each against the
#                                         # 4B's and the 30B as it is (bench_ratio rounds), ~7 min
#   bash scripts/gpu_moe.sh sorts OUT     # which sort the dispatch compiles to (either form), then the 30B's fp8
#                                         # encoder without FUSED_ROUTER and PAIR_SORT (bench_ratio), ~5 min
#   bash scripts/gpu_moe.sh spills OUT    # ptxas on the fp8 expert kernels (registers, spills; PTX in
#                                         # OUT/dumps.tar.gz), then the forms timed back to back, ~5 min
#   bash scripts/gpu_moe.sh passcost OUT  # the 30B fp8 trainer cold (1 update) compiling six, two, four and one
#                                         # packed pass sizes (scripts/train_pass_sizes.py), ~9 min
#   bash scripts/gpu_moe.sh passcheck OUT # the packed GPU tests, then the 30B fp8 trainer cold (4 updates) with the
#                                         # default pass sizes and the six of before, ~8 min
#   bash scripts/gpu_moe.sh passcheck4b OUT  # the small-passes test on the GPU, then the 4B fp8 trainer cold (2
#                                         # updates) with the default pass sizes and the six of before, ~4 min
#   bash scripts/gpu_moe.sh ncu OUT       # Nsight Compute on the fp8 expert kernels in the model's forms (down
#                                         # with row scales and on block-scaled rows; source counters: local
#                                         # memory) and cuBLAS's dense fp8 GEMMs: OUT/ncu_*.key.txt, ~4 min
#   bash scripts/gpu_moe.sh ncusass OUT   # both fp8 down forms' SASS with warp-stall samples per instruction
#                                         # (Nsight Compute's source page, CSV), ~3 min
#   bash scripts/gpu_moe.sh blocksweep OUT  # cuBLAS's fp8 GEMM with block scales vs per-tensor at down's shape,
#                                         # then the block-scaled down's config sweep in rounds, ~8 min
#   bash scripts/gpu_moe.sh scaleforms OUT  # down's fp8 GEMM per scale form: XLA's dense, cuBLAS's (torch) and
#                                         # ours in one process, rounds; then the bf16 half of clocks, ~9 min
#   bash scripts/gpu_moe.sh yardsticks OUT  # every fp8 expert GEMM against both dense yardsticks in one process
#                                         # each (XLA's one-scale GEMM, cuBLAS's on the same scales), rounds;
#                                         # then every expert GEMM form against dense in rounds (fp8), ~9 min
#   bash scripts/gpu_moe.sh hiddenforms OUT  # the fp8 ratio with the hidden rows on block scales and per row, on
#                                         # the random and the spread routing, one process, ~9 min
#   bash scripts/gpu_moe.sh blocks OUT    # the fp8 experts' hidden rows in 128-wide blocks (moe.FP8_HIDDEN, the
#                                         # default): the GPU tests of the kernels and the block, then the 30B's fp8
#                                         # encoder with it and per row (fp8-moe-hidden-rows) against the 4B's
#                                         # (bench_ratio rounds, one process), ~8 min
#   bash scripts/gpu_moe.sh blocksprofile OUT  # the 30B's fp8 encoder kernel by kernel with the hidden rows in
#                                         # blocks (the default) and per row (one process), then the 30B fp8
#                                         # trainer cold (3 updates), ~8 min
#   bash scripts/gpu_moe.sh blockkernels OUT  # the e4m3 expert kernels alone (bench_moe.py --fp8, 36,864 tokens):
#                                         # gate+up writing bf16 then the quantisation pass vs quantising in its
#                                         # epilogue, down per-row scaled vs block-scaled (each form; 128- and
#                                         # 64-wide blocks), ~4 min; with RATIO_VARIANTS (bench_encoder variants)
#                                         # then the fp8 encoders' ratio with them (MOVEMENT= skips the movement
#                                         # rows, PIPELINE_TILES=1 the unpipelined ones; BLOCK_TESTS=1 runs the
#                                         # block kernels' GPU tests first; SHAPES=gate_up: that GEMM only)
#   bash scripts/gpu_moe.sh routingreport OUT  # scripts/moe_routing_report.py at the 30B's shape (random weights):
#                                         # fp8's routing flips against bf16 and the expert load on 32 real
#                                         # Craftax-Symbolic prompts (compiled; op by op it did not finish
#                                         # the bf16 model in 9 min), ~5 min
#   bash scripts/gpu_moe.sh spread OUT    # the encoders' ratio (fp8, then bf16) with the 30B's routing spread
#                                         # evenly over the experts (bench_encoder's *-moe-spread-routing) next to
#                                         # the random model's own, ~9 min
#   bash scripts/gpu_moe.sh scattered OUT # the ratios (fp8, then bf16) with the routing spread at random over the
#                                         # experts (*-moe-scattered-routing: padded tiles, as a trained router's), ~8 min
#   bash scripts/gpu_moe.sh prefetch OUT  # the L2 prefetch of each expert's weights (grouped_gemm.PREFETCH): its GPU
#                                         # test, the bf16 ratio without (the default) and with it (even routing),
#                                         # fp8 with (the default) and without it, ~7 min
#   bash scripts/gpu_moe.sh routingkernels OUT  # the fp8 expert kernels alone on the random 30B's routing and on a
#                                         # spread one, then under Nsight Compute each way, ~7 min
#   bash scripts/gpu_moe.sh splitrows OUT # down with its compute warpgroups splitting each tile's rows
#                                         # (grouped_gemm.split_rows): its GPU tests, fp8 and bf16 down in both forms
#                                         # against dense (uniform and even routing), the fp8 and bf16 ratios with
#                                         # and without it, ~9 min
#   bash scripts/gpu_moe.sh kernelrounds OUT  # every expert GEMM form (fp8, then bf16; both shapes, uniform and
#                                         # even routing) against dense in 7 alternating rounds (bench_moe --rounds):
#                                         # the "of dense" table's rows, ~4 min
#   bash scripts/gpu_moe.sh gateupsplit OUT  # the fp8 ratio with gate+up's warpgroups splitting the tile's rows
#                                         # (variant fp8-moe-blocks-split-rows; 3% faster alone in kernelrounds)
#                                         # and without, 5 alternating rounds, ~4 min
#   bash scripts/gpu_moe.sh clocks OUT    # the SM clock, power and throttle reasons in each timed window of the fp8
#                                         # ratio (the 30B on both routings, the 4B: scripts/gpu_clocks.py), then
#                                         # the same in bf16, ~8 min
#   OLD_TREE=DIR bash scripts/gpu_moe.sh coldstart OUT  # the 30B bf16 trainer cold (2 updates) here, then in an
#                                         # older tree DIR on the same machine: what a change cost the first status
#                                         # line. DIR: `git archive REV | tar -x -C DIR` (an empty DIR), carried
#                                         # (run's carry: [".device_carry", "shared"]), ~7 min
set -uo pipefail
stage=${1:?stage: kernels | tiled | check | encoder | train | recheck | h200 | fp8 | fp8kernels | movement | rows | norms | topk | ratio | profiles | swiglu | epilogues | downscales | defaults | capacity | pipelined | rounds | candidates | silu | breakdown | merge | confirm | routing | spills | ncu | ncusass | blocksweep | scaleforms | yardsticks | hiddenforms | passcost | passcheck | passcheck4b | blocks | blocksprofile | blockkernels | routingreport | spread | scattered | prefetch | routingkernels | splitrows | kernelrounds | gateupsplit | clocks | coldstart}
out=${2:?output directory}
mkdir -p "$out" && out=$(cd "$out" && pwd)
source "$(ls -d shared ../shared 2>/dev/null | head -1)/device/setup.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
# Qwen3-30B-A3B's bf16 weights are 57 GiB: JAX's allocator must be allowed more than its default 75% of an H100
# (the h200 stage measures what fits at the default)
[ "$stage" = h200 ] || [ "$stage" = fp8 ] || export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
python3 -c "import jax; print('allocator limit GiB', jax.devices()[0].memory_stats()['bytes_limit'] / 2**30)" | tee -a "$out/gpu.txt"
run() { local name=$1 limit=$2; shift 2; echo "== $name (limit ${limit}s): $*"; echo "$name" > /tmp/moe-step
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; }
# sample_memory: the GPU memory in use every second, with the step running then, into OUT/memory.csv (background)
sample_memory() { while sleep 1; do
  echo "$(cat /tmp/moe-step 2>/dev/null),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)"
done >> "$out/memory.csv"; }
case $stage in
  kernels)
    run moe_test 120 python3 -m pytest -q -x tests/test_llm_moe.py -k "mgpu or tiny or fp8"
    run moe_kernels 420 python3 scripts/bench_moe.py --tune --tune-seconds 120 --out "$out/moe_kernels.json"
    ;;
  tiled)  # our grouped GEMM (jaxllm.grouped_gemm): correctness, kernels side by side, the block, encoders, trainer
    [ -n "${WITH_TESTS:-}" ] && run tiled_test 120 python3 -m pytest -q -x tests/test_llm_grouped_gemm.py \
      tests/test_llm_moe.py -k "gpu or tiled"
    # the block's max_rel_err_vs_first compares the tiled block (SwiGLU fused) with the mgpu one
    run moe_tiled 135 python3 scripts/bench_moe.py --candidates dense mgpu tiled --routings uniform --tune-tiled \
      --tune-seconds 35 --block-impls mgpu tiled --out "$out/moe_tiled.json"
    for model in qwen3-30b-a3b qwen3-4b; do
      run "encoder_$model" 125 python3 scripts/bench_encoder.py --ragged --model "$model" --dtypes bfloat16 \
        --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_$model.json"
    done
    run train_30b_bfloat16 175 python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype bfloat16 \
      --skip-n 8 --num-envs 128 --max-updates 3 --compile-cache off --run-dir "$out/run30b-bfloat16"
    tail -n 3 "$out/run30b-bfloat16/metrics.jsonl" 2>/dev/null
    ;;
  check)  # after a change to the sparse block: the GPU kernel test, the block alone, the 30B encoder in bf16
    run moe_test 120 python3 -m pytest -q tests/test_llm_moe.py -k "mgpu or tiny or fp8"
    run moe_block 120 python3 scripts/bench_moe.py --routings uniform --candidates mgpu --out "$out/moe_block.json"
    run encoder_qwen3-30b-a3b 240 python3 scripts/bench_encoder.py --ragged --model qwen3-30b-a3b --dtypes bfloat16 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-30b-a3b.json"
    ;;
  encoder)
    for model in qwen3-30b-a3b qwen3-4b; do
      run "encoder_$model" 270 python3 scripts/bench_encoder.py --ragged --model "$model" --dtypes bfloat16 fp8 \
        --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_$model.json"
    done
    ;;
  recheck)
    run moe_block 90 python3 -u scripts/bench_moe.py --candidates tiled --routings uniform --block-impls tiled \
      --profile-block /tmp/moe-profile --out "$out/moe_block.json"
    for model in qwen3-30b-a3b qwen3-4b; do
      # the 30B's random init alone took 74 s on an H100: 120 s did not leave room for its compile and timing
      run "encoder_$model" 200 python3 -u scripts/bench_encoder.py --ragged --model "$model" --dtypes bfloat16 \
        --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_$model.json"
    done
    run train_30b_bfloat16 200 python3 -u -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype bfloat16 \
      --skip-n 8 --num-envs 128 --max-updates 4 --compile-cache off --run-dir "$out/run30b-bfloat16"
    tail -n 3 "$out/run30b-bfloat16/metrics.jsonl" 2>/dev/null
    ;;
  h200)
    sample_memory & sampler=$!
    for model in qwen3-30b-a3b qwen3-4b; do
      limit=$([ "$model" = qwen3-4b ] && echo 120 || echo 240)
      run "encoder_$model" "$limit" python3 -u scripts/bench_encoder.py --ragged --model "$model" --dtypes bfloat16 fp8 \
        --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_$model.json"
    done
    run train_30b_bfloat16 200 python3 -u -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype bfloat16 \
      --skip-n 8 --num-envs 128 --max-updates 4 --compile-cache off --run-dir /tmp/run30b-bfloat16
    tail -n 3 /tmp/run30b-bfloat16/metrics.jsonl 2>/dev/null
    kill "$sampler"
    echo "peak GPU memory in use per step (MiB, nvidia-smi):"
    sort -t, -k2 -n "$out/memory.csv" | awk -F, '{peak[$1] = $2} END {for (s in peak) print s, peak[s]}'
    ;;
  fp8|rows)
    run gpu_tests 110 python3 -m pytest -q -x tests/test_llm_grouped_gemm.py tests/test_llm_moe_rows.py \
      tests/test_llm_fp8.py -k "gpu or compiled"
    [ "$stage" = rows ] && run moe_rows 100 python3 -u scripts/bench_moe.py --fp8 --movement --candidates dense \
      --routings uniform --block-impls tiled --out "$out/moe_rows.json"
    for model in qwen3-30b-a3b qwen3-4b; do
      limit=$([ "$model" = qwen3-4b ] && echo 150 || echo 220)
      # the 30B's passes profiled after timing (OUT/encoder_qwen3-30b-a3b.log: where its GPU time goes)
      profile=$([ "$model" = qwen3-4b ] || echo "--profile /tmp/encoder-profile")
      run "encoder_$model" "$limit" python3 -u scripts/bench_encoder.py --ragged --model "$model" --dtypes bfloat16 fp8 \
        --methods packed --no-hf --no-gemm-ceiling $profile --out "$out/encoder_$model.json"
    done
    ;;
  norms)
    run gpu_tests 100 python3 -m pytest -q tests/test_llm_fp8.py -k "compiled"
    run encoder_qwen3-30b-a3b 260 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-xla-norms --methods packed --no-hf --no-gemm-ceiling --profile /tmp/encoder-profile \
      --out "$out/encoder_qwen3-30b-a3b.json"
    run encoder_qwen3-4b 120 python3 -u scripts/bench_encoder.py --ragged --model qwen3-4b --dtypes fp8 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    ;;
  topk)
    run gpu_tests 60 python3 -m pytest -q tests/test_llm_top_k.py -k compiled
    run encoder_qwen3-30b-a3b 230 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-xla-topk --methods packed --no-hf --no-gemm-ceiling --profile /tmp/encoder-profile \
      --out "$out/encoder_qwen3-30b-a3b.json"
    run encoder_qwen3-4b 170 python3 -u scripts/bench_encoder.py --ragged --model qwen3-4b --dtypes fp8 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    run train_30b_fp8 170 python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 --skip-n 8 \
      --num-envs 128 --max-updates 5 --compile-cache off --run-dir /tmp/run30b-fp8
    ;;
  ratio)
    encoder() { local name=$1 model=$2 limit=$3
      run "$name" "$limit" python3 -u scripts/bench_encoder.py --ragged --model "$model" --dtypes fp8 --methods packed \
        --no-hf --no-gemm-ceiling --out "$out/$name.json"; }
    encoder encoder_qwen3-30b-a3b qwen3-30b-a3b 150
    encoder encoder_qwen3-4b qwen3-4b 170
    XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
      encoder encoder_qwen3-30b-a3b_while_graphs qwen3-30b-a3b 150
    ;;
  profiles)
    for model in qwen3-30b-a3b qwen3-4b; do
      limit=$([ "$model" = qwen3-4b ] && echo 160 || echo 220)
      run "encoder_$model" "$limit" python3 -u scripts/bench_encoder.py --ragged --model "$model" --dtypes fp8 \
        --methods packed packed-one-pass --no-hf --no-gemm-ceiling --profile "/tmp/encoder-profile-$model" \
        --out "$out/encoder_$model.json"
    done
    ;;
  swiglu)
    run gpu_tests 80 python3 -m pytest -q tests/test_llm_grouped_gemm.py tests/test_llm_fp8.py -k "fp8 and gpu or compiled_combine"
    run encoder_qwen3-30b-a3b 230 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-fused-combine fp8-moe-swiglu-kernel --methods packed --no-hf --no-gemm-ceiling \
      --profile /tmp/encoder-profile --out "$out/encoder_qwen3-30b-a3b.json"
    run encoder_qwen3-4b 115 python3 -u scripts/bench_encoder.py --ragged --model qwen3-4b --dtypes fp8 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    run train_30b_fp8 150 python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 --skip-n 8 \
      --num-envs 128 --max-updates 4 --compile-cache off --run-dir /tmp/run30b-fp8
    ;;
  epilogues)
    run gpu_tests 120 python3 -m pytest -q tests/test_llm_grouped_gemm.py tests/test_llm_moe_rows.py \
      tests/test_llm_fp8.py -k "gpu or compiled"
    run moe_fp8 380 python3 -u scripts/bench_moe.py --fp8 --movement --candidates dense tiled --routings uniform \
      --tune-tiled --tune-seconds 100 --block-impls tiled --out "$out/moe_fp8.json"
    ;;
  downscales)
    run gpu_tests 110 python3 -m pytest -q tests/test_llm_grouped_gemm.py tests/test_llm_moe_rows.py \
      -k "fp8 and gpu or gather_equals_take_on_gpu"
    run encoder_qwen3-30b-a3b 250 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-down-scales-combine --methods packed --no-hf --no-gemm-ceiling \
      --profile /tmp/encoder-profile --out "$out/encoder_qwen3-30b-a3b.json"
    run encoder_qwen3-4b 120 python3 -u scripts/bench_encoder.py --ragged --model qwen3-4b --dtypes fp8 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    ;;
  defaults)
    # the defaults since 2026-11-29's eleventh session (rows scattered, passes of up to 36,864 tokens), each model's
    # rows in one process: the 30B's bf16 and fp8 also with the rows gathered (moe.ROW_COPY = "gather")
    run encoder_qwen3-30b-a3b 300 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-gather bfloat16 bfloat16-moe-gather --methods packed --no-hf --no-gemm-ceiling \
      --out "$out/encoder_qwen3-30b-a3b.json"
    run encoder_qwen3-4b 150 python3 -u scripts/bench_encoder.py --ragged --model qwen3-4b --dtypes fp8 bfloat16 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    # the trainer cold with what is left of a 540 s call (SECONDS: since the script started), if 100 s or more
    left=$((540 - SECONDS))
    [ "$left" -ge 100 ] && run train_30b_fp8 "$left" python3 -m rl.train --encoder inscan --model qwen3-30b-a3b \
      --llm-dtype fp8 --skip-n 8 --num-envs 128 --max-updates 3 --compile-cache off --run-dir /tmp/run30b-fp8
    ;;
  capacity)
    # the trainer with packed passes of up to 36,864 tokens (the default since 2026-11-29) against 32,768 (before):
    # both fp8 models cold, 128 envs, skip_n 8, 5 updates each, the GPU memory in use sampled every second
    sample_memory & sampler=$!
    for model in qwen3-30b-a3b qwen3-4b; do
      for cap in 0 32768; do
        run "train_${model}_fp8_capacity_$cap" "$([ "$model" = qwen3-4b ] && echo 120 || echo 150)" \
          python3 -m rl.train --encoder inscan --model "$model" --llm-dtype fp8 --skip-n 8 --num-envs 128 \
          --max-updates 5 --llm-capacity "$cap" --compile-cache off --run-dir "/tmp/run-$model-$cap"
        tail -n 4 "/tmp/run-$model-$cap/metrics.jsonl" > "$out/metrics_${model}_$cap.jsonl" 2>/dev/null
      done
    done
    kill "$sampler"
    echo "peak GPU memory in use per step (MiB, nvidia-smi):"
    sort -t, -k2 -n "$out/memory.csv" | awk -F, '{peak[$1] = $2} END {for (s in peak) print s, peak[s]}'
    ;;
  fp8kernels)
    run moe_fp8 280 python3 -u scripts/bench_moe.py --fp8 --candidates dense tiled --routings uniform --tune-tiled \
      --tune-seconds 60 --block-impls tiled --profile-block /tmp/moe-fp8-profile --out "$out/moe_fp8.json"
    ;;
  movement)
    run gpu_tests 120 python3 -m pytest -q tests/test_llm_moe_rows.py tests/test_llm_fp8.py \
      tests/test_llm_grouped_gemm.py -k "gpu or compiled"
    run moe_fp8 270 python3 -u scripts/bench_moe.py --fp8 --movement --candidates dense tiled --routings uniform \
      --tune-tiled --tune-seconds 50 --block-impls tiled --profile-block /tmp/moe-fp8-profile --out "$out/moe_fp8.json"
    run moe_bf16 130 python3 -u scripts/bench_moe.py --candidates dense tiled --routings uniform --tune-tiled \
      --tune-seconds 45 --block-impls tiled --out "$out/moe_bf16.json"
    ;;
  pipelined)
    # down's GEMM pipelined (moe.PIPELINED_DOWN, the default since the twelfth session): the 30B's fp8 encoder with
    # and without (one process; the second row's min_cosine_vs_reference compares the two), the 4B's fp8 encoder;
    # WITH_TESTS=1 first runs the GPU tests of the pipelined kernel and the fp8 block
    [ -n "${WITH_TESTS:-}" ] && run pipelined_test 150 python3 -m pytest -q tests/test_llm_grouped_gemm.py \
      -k "pipelined or fp8_swiglu_epilogue_on_gpu"
    run encoder_qwen3-30b-a3b 170 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-unpipelined --methods packed --no-hf --no-gemm-ceiling \
      --out "$out/encoder_qwen3-30b-a3b.json"
    run encoder_qwen3-4b 130 python3 -u scripts/bench_encoder.py --ragged --model qwen3-4b --dtypes fp8 \
      --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    ;;
  candidates)
    # the GPU tests of gate+up's SiLU forms and of the fp8 epilogues' 128-row pieces, then the 30B's fp8 encoder
    # as it is and with each of $VARIANTS (bench_encoder's), against the 4B's in the same process, alternating
    # rounds (scripts/bench_ratio.py); ran at 74bb9ca with the variants of that commit (the SiLU by ex2 + rsqrt,
    # 128-row pieces, the SiLU by expf)
    run candidates_test 150 python3 -m pytest -q tests/test_llm_grouped_gemm.py \
      -k "silu_forms_on_gpu or epilogue_pieces_of_128_rows_change_nothing_on_gpu"
    run ratio_fp8_candidates $((480 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 4 --iters 8 --variants ${VARIANTS:-fp8-moe-silu-exp fp8-moe-epi64} \
      --out "$out/ratio_fp8_candidates.json"
    ;;
  rounds)
    # the encoders' ratio with both models in one process, timed in alternating rounds (scripts/bench_ratio.py):
    # fp8, then bf16, ~9 min
    run ratio_fp8 280 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 --rounds 6 \
      --out "$out/ratio_fp8.json"
    left=$((575 - SECONDS))
    [ "$left" -ge 150 ] && run ratio_bfloat16 "$left" python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b \
      qwen3-4b --dtype bfloat16 --rounds 4 --out "$out/ratio_bfloat16.json"
    ;;
  silu)
    # the SwiGLU epilogue's exponential as one ex2.approx (grouped_gemm.SILU "exp2", the default) against CUDA's
    # expf: the GPU tests, the gate+up kernels both ways with calls back to back (fp8 and bf16), the 30B's fp8
    # encoder both ways (one process), the 4B's fp8 encoder, ~9.5 min
    run silu_test 150 python3 -m pytest -q tests/test_llm_grouped_gemm.py -k "silu_forms_on_gpu or fp8_swiglu_epilogue_on_gpu"
    for dtype in fp8 bf16; do
      run "silu_kernels_$dtype" 100 python3 -u scripts/bench_moe.py $([ $dtype = fp8 ] && echo --fp8) --shapes gate_up \
        --candidates dense tiled --routings uniform --iters 10 --back-to-back 10 --silu exp2 exp exp2 \
        --out "$out/silu_kernels_$dtype.json"
    done
    # (a process spends ~65 s before its first prompt on some machines: the limits leave room for it)
    run encoder_qwen3-30b-a3b 250 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-silu-exp fp8 --methods packed --no-hf --no-gemm-ceiling \
      --out "$out/encoder_qwen3-30b-a3b.json"
    left=$((575 - SECONDS))
    [ "$left" -ge 100 ] && run encoder_qwen3-4b "$left" python3 -u scripts/bench_encoder.py --ragged \
      --model qwen3-4b --dtypes fp8 --methods packed --no-hf --no-gemm-ceiling --out "$out/encoder_qwen3-4b.json"
    ;;
  breakdown)
    # where each fp8 encoder's GPU time goes, kernel by kernel (400 listed), one process per model; the 30B's
    # optimised HLO names what each XLA fusion computes
    for model in qwen3-30b-a3b qwen3-4b; do
      limit=$([ "$model" = qwen3-4b ] && echo 170 || echo 230)
      hlo=$([ "$model" = qwen3-4b ] || echo "--hlo-dir /tmp/hlo")
      # shellcheck disable=SC2086
      run "breakdown_$model" "$limit" python3 -u scripts/bench_encoder.py --ragged --model "$model" --dtypes fp8 \
        --methods packed --no-hf --no-gemm-ceiling --profile "/tmp/encoder-profile-$model" --profile-top 400 \
        $hlo --out "$out/breakdown_$model.json"
    done
    [ -d /tmp/hlo ] && tar -C /tmp -czf "$out/hlo.tar.gz" hlo
    ;;
  merge)
    # packed_attention.FUSED_MERGE_QUANTIZE (on) and moe._group_starts: their GPU tests and the fp8 block's, the
    # merge kernel's settings against XLA's merge + the quantisation kernel at 36,864 tokens x 32 heads of 128,
    # then both fp8 encoders as they are and with each of $VARIANTS (on both models), alternating rounds; ran at
    # 1e9d029 with that commit's variants (the merge on 3-d blocks of 4 heads, 8 heads a load)
    run merge_test 170 python3 -m pytest -q tests/test_llm_fp8.py tests/test_llm_packed.py \
      tests/test_llm_grouped_gemm.py -k "compiled_merge or merged_in_the_quantisation or fp8_tiled_kernel_and_block"
    run merge_kernels 100 python3 -u scripts/bench_layer_kernels.py --sections merge --tokens 36864 --iters 20 \
      --out "$out/merge_kernels.json"
    run ratio_fp8_merge $((585 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 4 --iters 8 --variants ${VARIANTS:-fp8-xla-merge} \
      --variants-on both --out "$out/ratio_fp8_merge.json"
    ;;
  blocks)
    # the hidden rows quantised in blocks inside gate+up's epilogue, down on block-scaled rows (the default): the
    # kernels' and the fp8 block's GPU tests, then the fp8 encoders' ratio with it and per row (one process)
    run blocks_test 200 python3 -m pytest -q tests/test_llm_grouped_gemm.py \
      -k "block_scaled_hidden_kernels_on_gpu or fp8_tiled_kernel_and_block_on_gpu or fp8_swiglu_epilogue_on_gpu" \
      | tail -40
    run ratio_fp8_blocks $((560 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 4 --iters 8 --variants ${VARIANTS:-fp8-moe-hidden-rows} \
      --out "$out/ratio_fp8_blocks.json"
    ;;
  blockkernels)
    [ -n "${BLOCK_TESTS:-}" ] && run block_tests 100 python3 -m pytest -q tests/test_llm_grouped_gemm.py \
      -k "block_scaled_hidden_kernels_on_gpu or fp8_tiled_kernel_and_block_on_gpu"
    run kernels_fp8_blocks 200 python3 -u scripts/bench_moe.py --fp8 --routings uniform --candidates tiled \
      --pipeline-tiles ${PIPELINE_TILES:-0 1} --tokens 36864 ${MOVEMENT---movement} --shapes ${SHAPES:-gate_up down} \
      --out "$out/kernels_fp8_blocks.json"
    [ -n "${RATIO_VARIANTS:-}" ] && run ratio_fp8_blocks $((560 - SECONDS)) python3 -u scripts/bench_ratio.py \
      --models qwen3-30b-a3b qwen3-4b --dtype fp8 --rounds 4 --iters 8 --variants $RATIO_VARIANTS \
      --out "$out/ratio_fp8_blocks.json"
    ;;
  spread)  # the encoders' ratio with the 30B's tokens spread evenly over the experts, as a trained router's are
    # (the random 30B sends nearly every token to the same 8 experts), fp8 then bf16
    run ratio_fp8_spread 270 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 \
      --rounds 4 --iters 8 --variants fp8-moe-spread-routing --out "$out/ratio_fp8_spread.json"
    run ratio_bf16_spread $((580 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype bfloat16 --rounds 3 --iters 6 --variants bfloat16-moe-spread-routing --out "$out/ratio_bf16_spread.json"
    ;;
  prefetch)  # the expert kernels' L2 prefetch of each expert's weights a wave ahead (grouped_gemm.PREFETCH):
    # unchanged values, then the bf16 ratio (rows spread) and the fp8 one (the random model's routing), each way
    run prefetch_test 150 python3 -m pytest -q -x tests/test_llm_grouped_gemm.py -k "prefetch"
    run ratio_bf16_prefetch 230 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype bfloat16 --rounds 3 --iters 6 --variants bfloat16-moe-spread-routing bfloat16-moe-spread-prefetch \
      --out "$out/ratio_bf16_prefetch.json"
    run ratio_fp8_prefetch $((575 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 3 --iters 8 --variants fp8-moe-no-prefetch fp8-moe-scattered-routing \
      --out "$out/ratio_fp8_prefetch.json"
    ;;
  routingkernels)  # the fp8 expert kernels alone with every token on the same 8 experts (the random 30B's routing)
    # and with every expert the same rows (a trained router's spread), then Nsight Compute on gate+up and down each way
    run routing_kernels 200 python3 -u scripts/bench_moe.py --fp8 --candidates tiled --routings same even \
      --back-to-back 4 --out "$out/routing_kernels.json"
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for routing in same even; do
      for form in "gate_up 0" "down 1"; do
        # shellcheck disable=SC2086
        set -- $form
        timeout 80 "$ncu_bin" --clock-control none --kernel-name regex:mosaic --launch-skip 4 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
          --section SchedulerStats python3 -u scripts/bench_moe.py --fp8 --shapes "$1" --pipeline-tiles "$2" \
          --candidates tiled --routings "$routing" --iters 1 > "$out/ncu_${1}_$routing.txt" 2>&1
        grep -vE "^\[|^\s*-+" "$out/ncu_${1}_$routing.txt" | grep -iE "_kernel|Duration|Throughput|Hit Rate|Stall|Eligible|Warp Cycles" \
          > "$out/ncu_${1}_$routing.key.txt"; gzip -f "$out/ncu_${1}_$routing.txt"
      done
    done
    ;;
  kernelrounds)  # each row's ratio to dense per round, dense timed seconds before it in the same round
    run kernel_rounds_fp8 200 python3 -u scripts/bench_moe.py --fp8 --candidates dense tiled --routings uniform even \
      --back-to-back 10 --pipeline-tiles 1 --rounds 7 --out "$out/kernel_rounds_fp8.json"
    run kernel_rounds_bf16 200 python3 -u scripts/bench_moe.py --candidates dense tiled --routings uniform even \
      --back-to-back 10 --pipeline-tiles 0 1 --rounds 7 --out "$out/kernel_rounds_bf16.json"
    ;;
  gateupsplit)
    run ratio_fp8_gate_up_split 400 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 \
      --rounds 5 --iters 8 --variants fp8-moe-blocks-split-rows --out "$out/ratio_fp8_gate_up_split.json"
    ;;
  splitrows)  # down with its compute warpgroups splitting each tile's rows (64 x 256 each) instead of its
    # columns (128 x 128 each): its GPU tests, the kernels against dense (back to back, uniform and even routing,
    # pipelined as the model runs down), then the encoders' ratio with the form as it is and split (one process each)
    run split_rows_test 150 python3 -m pytest -q tests/test_llm_grouped_gemm.py \
      -k "split_rows_down_on_gpu or block_scaled_hidden_kernels_on_gpu" | tail -30
    run kernels_split_fp8 120 python3 -u scripts/bench_moe.py --fp8 --shapes down --candidates dense tiled \
      --routings uniform even --back-to-back 10 --pipeline-tiles 1 --out "$out/kernels_split_fp8.json"
    run kernels_split_bf16 90 python3 -u scripts/bench_moe.py --shapes down --candidates dense tiled \
      --routings uniform even --back-to-back 10 --pipeline-tiles 1 --out "$out/kernels_split_bf16.json"
    run ratio_fp8_split $((400 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 3 --iters 8 --variants fp8-moe-down-split-rows --out "$out/ratio_fp8_split.json"
    run ratio_bf16_split $((575 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype bfloat16 --rounds 3 --iters 8 --variants bfloat16-moe-down-split-rows \
      --out "$out/ratio_bf16_split.json"
    ;;
  clocks)  # where the power cap leaves each encoder's clock: every timed window of the ratio, fp8 then bf16
    run clocks_fp8 280 python3 -u scripts/gpu_clocks.py --out "$out/clocks_fp8" -- python3 -u scripts/bench_ratio.py \
      --models qwen3-30b-a3b qwen3-4b --dtype fp8 --rounds 3 --iters 24 --variants fp8-moe-spread-routing \
      --out "$out/clocks_fp8/ratio.json"
    run clocks_bf16 $((570 - SECONDS)) python3 -u scripts/gpu_clocks.py --out "$out/clocks_bf16" -- python3 -u \
      scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype bfloat16 --rounds 3 --iters 16 \
      --variants bfloat16-moe-spread-routing --out "$out/clocks_bf16/ratio.json"
    ;;
  scattered)  # the encoders' ratio with the routing spread evenly and spread at random (padded tiles), fp8 then bf16
    run ratio_fp8_scattered 250 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 \
      --rounds 3 --iters 8 --variants fp8-moe-spread-routing fp8-moe-scattered-routing \
      --out "$out/ratio_fp8_scattered.json"
    run ratio_bf16_scattered $((540 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype bfloat16 --rounds 3 --iters 6 --variants bfloat16-moe-scattered-routing \
      --out "$out/ratio_bf16_scattered.json"
    ;;
  routingreport)  # routing flips fp8 vs bf16 and the expert load at the 30B's shape, random weights, real prompts
    run routing_report ${LIMIT:-560} python3 -u scripts/moe_routing_report.py --model qwen3-30b-a3b --prompts 32 \
      --reference bfloat16 --dtypes fp8 --env Craftax-Symbolic-v1 --out "$out/routing_report.json"
    ;;
  blocksprofile)
    run profile_blocks 240 python3 -u scripts/bench_encoder.py --ragged --model qwen3-30b-a3b \
      --dtypes fp8 fp8-moe-hidden-rows --methods packed --no-hf --no-gemm-ceiling --profile /tmp/encoder-profile \
      --profile-top 40 --out "$out/profile_blocks.json"
    run train_30b_fp8 $((585 - SECONDS)) python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 \
      --skip-n 8 --num-envs 128 --max-updates 3 --compile-cache off --run-dir /tmp/run30b-fp8
    cp /tmp/run30b-fp8/metrics.jsonl "$out/train_30b_fp8_metrics.jsonl" 2>/dev/null
    ;;
  confirm)
    # the code as it stands: the routing's GPU tests (the router kernel, the dispatch's CUB sort), the fp8 encoders'
    # ratio in alternating rounds, then the 30B fp8 trainer cold
    run routing_test 100 python3 -m pytest -q tests/test_llm_top_k.py tests/test_llm_moe.py -k compiled
    run ratio_fp8 240 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 --rounds 4 \
      --iters 8 --out "$out/ratio_fp8.json"
    run train_30b_fp8 $((585 - SECONDS)) python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 \
      --skip-n 8 --num-envs 128 --max-updates 3 --compile-cache off --run-dir /tmp/run30b-fp8
    cp /tmp/run30b-fp8/metrics.jsonl "$out/train_30b_fp8_metrics.jsonl" 2>/dev/null
    ;;
  confirm16)
    # the code as it stands in bf16: the encoders' ratio in alternating rounds, then the 30B bf16 trainer cold
    run ratio_bf16 280 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype bfloat16 \
      --rounds 3 --iters 6 --out "$out/ratio_bf16.json"
    run train_30b_bf16 $((585 - SECONDS)) python3 -m rl.train --encoder inscan --model qwen3-30b-a3b \
      --skip-n 8 --num-envs 128 --max-updates 3 --compile-cache off --run-dir /tmp/run30b-bf16
    cp /tmp/run30b-bf16/metrics.jsonl "$out/train_30b_bf16_metrics.jsonl" 2>/dev/null
    ;;
  routing)
    # moe.FUSED_ROUTER and moe.PAIR_SORT (on): the router kernel's GPU test, the dispatch's sort
    # compiled to CUB either way, the fp8 block's test,
    # then the 30B's fp8 encoder as it is and without each, against the 4B's, alternating rounds
    run routing_test 170 python3 -m pytest -q tests/test_llm_top_k.py tests/test_llm_grouped_gemm.py \
      tests/test_llm_moe.py -k "compiled or fp8_tiled_kernel_and_block"
    run ratio_fp8_routing $((585 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 6 --iters 8 --variants fp8-moe-xla-router fp8-moe-key-sort \
      --out "$out/ratio_fp8_routing.json"
    ;;
  sorts)
    # which sort the dispatch compiles to on this GPU, either form (the lines naming a sort or CUB), then the 30B's
    # fp8 encoder without moe.FUSED_ROUTER and moe.PAIR_SORT against it as it is and the 4B's, ~5 min
    run sort_hlo 120 python3 - <<'PY'
import jax, jax.numpy as jnp
from jaxllm import moe
experts = jax.random.randint(jax.random.key(3), (36864, 8), 0, 128, jnp.int32)
for pair in (False, True):
    moe.PAIR_SORT = pair
    jax.clear_caches()
    text = jax.jit(lambda e: moe.dispatch(e, 128)).lower(experts).compile().as_text()
    lines = [line.strip()[:240] for line in text.splitlines() if "sort" in line.lower() or "cub" in line.lower()]
    print(f"PAIR_SORT={pair}: {len(lines)} lines naming a sort or CUB", *lines[:12], sep="\n  ")
PY
    run ratio_fp8_routing $((585 - SECONDS)) python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b \
      --dtype fp8 --rounds 6 --iters 8 --variants fp8-moe-routing-before --out "$out/ratio_fp8_routing.json"
    ;;
  spills)
    # what ptxas makes of the fp8 expert kernels in the model's forms (gate+up scaled with SwiGLU, its SiLU's
    # exponential as ex2.approx and as expf; down scaled and pipelined): registers, spill stores/loads, and the
    # PTX (OUT/dumps.tar.gz), one process per form (each compiles its unscaled form first, then the model's form,
    # then the sparse block's two), then those forms timed back to back; ~5 min
    mkdir -p /tmp/dumps
    for form in "gate_up 0 exp2" "gate_up 0 exp" "down 1 exp2"; do  # shape, pipeline_tiles, SiLU
      # shellcheck disable=SC2086
      set -- $form
      name="dump_$1_pipe$2_$3"
      echo "== $name"
      timeout 100 env MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 python3 -u scripts/bench_moe.py --fp8 \
        --shapes "$1" --pipeline-tiles "$2" --silu "$3" --candidates tiled --routings uniform --iters 1 \
        > "/tmp/dumps/$name.log" 2>&1
      echo "rc $?"
      grep -E "ptxas|Used [0-9]+ registers|[Ss]pill|^\[ *[0-9.]+ s\]|Error|error" "/tmp/dumps/$name.log" \
        | grep -v "^\s*//" | cut -c1-400 | tee -a "$out/dumps.key.txt"
      printf "%s ex2 instructions in its PTX: " "$name" | tee -a "$out/dumps.key.txt"
      grep -c "ex2\.approx" "/tmp/dumps/$name.log" | tee -a "$out/dumps.key.txt"
    done
    tar -C /tmp -czf "$out/dumps.tar.gz" dumps
    run spill_kernels 200 python3 -u scripts/bench_moe.py --fp8 --candidates dense tiled --routings uniform \
      --iters 10 --back-to-back 10 --pipeline-tiles 0 1 --silu exp2 exp --out "$out/spill_kernels.json"
    ;;
  ncu)
    # Nsight Compute on the fp8 expert kernels in the model's forms (gate+up scaled with SwiGLU; down with row
    # scales, pipelined, and down on block-scaled rows, the default, to see where its rescale's 9% goes): each
    # bench row launches its kernel 4 times (one call, 2 warm-ups, 1 timed), so gate+up's and down's 5th launch is
    # the scaled form (after the unscaled one) and down's 13th the block-scaled one (after the row-scaled forms
    # split by columns and by rows); with source counters and instruction statistics (local-memory traffic:
    # the thirteenth session saw local loads and stores in gate+up), then cuBLAS's dense fp8 GEMMs of the same
    # FLOPs. The report is cut to its key lines on the device (a call returns at most 8 files), the full text
    # gzipped. ~4 min
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
      --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy
      --section InstructionStats --section SourceCounters"
    # the report's name, the shape, whether the model pipelines its tiles (down does), the launches skipped
    for form in "gate_up gate_up 0 4" "down down 1 4" "down_blocks down 1 12"; do
      # shellcheck disable=SC2086
      set -- $form
      # shellcheck disable=SC2086
      timeout 150 "$ncu_bin" --clock-control none --kernel-name regex:mosaic --launch-skip "$4" --launch-count 1 \
        $sections python3 -u scripts/bench_moe.py --fp8 --shapes "$2" --pipeline-tiles "$3" --candidates tiled \
        --routings uniform --iters 1 > "$out/ncu_$1.txt" 2>&1
    done
    # shellcheck disable=SC2086
    timeout 120 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" "$ncu_bin" --clock-control none \
      --kernel-name regex:"nvjet" --launch-count 8 $sections \
      python3 -u scripts/bench_moe.py --fp8 --candidates dense --routings uniform --iters 1 > "$out/ncu_dense.txt" 2>&1
    for f in ncu_gate_up ncu_down ncu_down_blocks ncu_dense; do
      grep -vE "^\[|^\s*-+" "$out/$f.txt" | grep -iE "_kernel|nvjet|Duration|Frequency|Throughput|Busy|Eligible|Warp Cycles|Registers|Shared Memory|Occupancy|Stall|stall|pipeline|local|spill|Speedup" \
        > "$out/$f.key.txt"; gzip -f "$out/$f.txt"; done
    head -c 6000 "$out/ncu_gate_up.key.txt"
    ;;
  ncusass)
    # where down's k-step rescale on block-scaled rows stalls, instruction by instruction: Nsight Compute's source
    # page (SASS with its warp-stall samples per instruction, CSV) for down with row scales (5th launch) and on
    # block-scaled rows (13th), plus each kernel's key lines as in `ncu`; ~3 min
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    "$ncu_bin" --version | tail -1
    for form in "down 4" "down_blocks 12"; do
      # shellcheck disable=SC2086
      set -- $form
      timeout 150 "$ncu_bin" --clock-control none --kernel-name regex:mosaic --launch-skip "$2" --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats --section SourceCounters \
        --section ComputeWorkloadAnalysis -o "/tmp/ncu_$1" -f python3 -u scripts/bench_moe.py --fp8 --shapes down \
        --pipeline-tiles 1 --candidates tiled --routings uniform --iters 1 > "$out/ncusass_$1.log" 2>&1
      timeout 60 "$ncu_bin" -i "/tmp/ncu_$1.ncu-rep" --page details > "$out/ncusass_$1.details.txt" 2>&1
      timeout 60 "$ncu_bin" -i "/tmp/ncu_$1.ncu-rep" --page source --csv --print-source sass \
        > "/tmp/ncusass_$1.sass.csv" 2>&1
      gzip -c "/tmp/ncusass_$1.sass.csv" > "$out/ncusass_$1.sass.csv.gz"
      head -c 400 "/tmp/ncusass_$1.sass.csv"; echo; wc -l "/tmp/ncusass_$1.sass.csv"
    done
    grep -iE "Duration|Throughput|Issued|Eligible|Warp Cycles|Stall" "$out"/ncusass_*.details.txt | head -60
    ;;
  blocksweep)
    # fp8 down on block-scaled rows: what cuBLAS pays for block scales at down's dense shape (torch._scaled_mm,
    # per-tensor vs per-row vs 1 x 128 blocks), then our kernel's config sweep for that form against dense, every
    # row re-timed in alternating rounds
    run scale_forms 200 python3 -u scripts/bench_scale_forms.py --rounds 7 --out "$out/scale_forms.json"
    run blocks_sweep $((570 - SECONDS)) python3 -u scripts/bench_moe.py --fp8 --shapes down --candidates dense \
      tiled --routings uniform --back-to-back 10 --pipeline-tiles 1 --tune-blocks --rounds 3 \
      --out "$out/blocks_sweep.json"
    ;;
  scaleforms)
    # down's fp8 GEMM at each scale granularity: XLA's dense, cuBLAS's (per-tensor, per-row, 1 x 128 blocks) and
    # ours (rows, blocks) in one process, alternating rounds; then the bf16 half of `clocks`
    run scale_forms 240 python3 -u scripts/bench_scale_forms.py --rounds 9 --out "$out/scale_forms.json"
    run clocks_bf16 $((575 - SECONDS)) python3 -u scripts/gpu_clocks.py --out "$out/clocks_bf16" -- python3 -u \
      scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype bfloat16 --rounds 3 --iters 16 \
      --variants bfloat16-moe-spread-routing --out "$out/clocks_bf16/ratio.json"
    ;;
  yardsticks)
    # issue 33's bar two ways: our fp8 down (row scales, block scales) and gate+up (the model's form) against XLA's
    # dense fp8 GEMM with one scale per operand and cuBLAS's dense GEMM on the same scales, one process per GEMM,
    # alternating rounds; then bench_moe's rounds of every fp8 expert GEMM form against dense
    run scale_forms_down 220 python3 -u scripts/bench_scale_forms.py --rounds 9 --out "$out/scale_forms_down.json"
    run scale_forms_gate_up 160 python3 -u scripts/bench_scale_forms.py --gemm gate_up --rounds 9 \
      --out "$out/scale_forms_gate_up.json"
    run kernel_rounds_fp8 $((580 - SECONDS)) python3 -u scripts/bench_moe.py --fp8 --candidates dense tiled \
      --routings uniform even --back-to-back 10 --pipeline-tiles 1 --rounds 7 --out "$out/kernel_rounds_fp8.json"
    ;;
  hiddenforms)
    # the fp8 encoders' ratio with the experts' hidden rows on 128-wide block scales (the default) and per row
    # (fp8-moe-hidden-rows: down at 0.78-0.81 of dense instead of 0.70-0.77, a quantisation pass more), on the
    # random routing and spread as a trained router's, every form in one process, alternating rounds
    run ratio_fp8_hidden 560 python3 -u scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 \
      --rounds 5 --iters 8 --variants fp8-moe-hidden-rows fp8-moe-spread-routing fp8-moe-spread-hidden-rows \
      --out "$out/ratio_fp8_hidden.json"
    ;;
  passcost)
    # what each compiled pass size costs the 30B fp8 trainer's cold start: the same cold run (1 update) with the
    # six sizes used before 2026-11-29, two (4,608 + 36,864), four (the halvings) and one (36,864), one process each
    run warm_imports 120 python3 -c "import jax, craftax, rl.train; print(jax.devices())"
    for sizes in six 4608,36864 4608,9216,18432,36864 36864; do
      left=$((590 - SECONDS)); [ $left -lt 60 ] && break
      run "cold_${sizes//,/_}" $((left < 175 ? left : 175)) python3 -u scripts/train_pass_sizes.py "$sizes" \
        --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 --skip-n 8 --num-envs 128 --max-updates 1 \
        --compile-cache off --run-dir "/tmp/run-$sizes"
    done
    ;;
  passcheck)
    # the three pass sizes (the default): the packed encoders' GPU tests, then the 30B fp8 trainer cold (4 updates)
    # with them and with the six of before, one process each
    run packed_test 120 python3 -m pytest -q tests/test_llm_packed.py
    for sizes in default six; do
      left=$((590 - SECONDS)); [ $left -lt 60 ] && break
      run "cold_$sizes" $((left < 200 ? left : 200)) python3 -u scripts/train_pass_sizes.py "$sizes" \
        --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 --skip-n 8 --num-envs 128 --max-updates 4 \
        --compile-cache off --run-dir "/tmp/run-$sizes"
      cp "/tmp/run-$sizes/metrics.jsonl" "$out/cold_${sizes}_metrics.jsonl" 2>/dev/null
    done
    ;;
  passcheck4b)
    # the GPU run of the small-passes test, then the 4B fp8 trainer cold (2 updates) with the default pass sizes
    # and the six of before, one process each
    run small_passes_test 100 python3 -m pytest -q -p no:cacheprovider tests/test_llm_packed.py -k small_passes
    for sizes in default six; do
      left=$((590 - SECONDS)); [ $left -lt 60 ] && break
      run "cold_4b_$sizes" $((left < 150 ? left : 150)) python3 -u scripts/train_pass_sizes.py "$sizes" \
        --encoder inscan --model qwen3-4b --llm-dtype fp8 --skip-n 8 --num-envs 128 --max-updates 2 \
        --compile-cache off --run-dir "/tmp/run-4b-$sizes"
    done
    ;;
  coldstart)
    old=$(cd "${OLD_TREE:?OLD_TREE: the older tree to compare with}" && pwd)
    train_30b=(python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype bfloat16 --skip-n 8
      --num-envs 128 --max-updates 2 --compile-cache off)
    run train_30b_here 220 "${train_30b[@]}" --run-dir "$out/run-here"
    # python -m puts the working directory first on sys.path: the old tree's packages win over PYTHONPATH's
    (cd "$old" && run train_30b_old 220 "${train_30b[@]}" --run-dir "$out/run-old")
    ;;
  train)
    for dtype in bfloat16 fp8; do
      run "train_30b_$dtype" 285 python3 -m rl.train --encoder inscan --model qwen3-30b-a3b --llm-dtype "$dtype" \
        --skip-n 8 --num-envs 128 --max-updates 5 --compile-cache off --run-dir "$out/run30b-$dtype"
    done
    ;;
esac

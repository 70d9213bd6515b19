#!/usr/bin/env bash
# Issue 23's GPU measurements, one stage per device call (each well under 10 minutes on an H100).
#   bash scripts/gpu_fast_llm.sh encoder OUT   # fp8 HLO report, encoder packed bf16/fp8 (+ fp8 with XLA's SwiGLU
#                                              # quantisation), each row profiled by kernel kind
#   bash scripts/gpu_fast_llm.sh kernels OUT   # the one-pass kernels' GPU tests, encoder bf16/fp8 (+ fp8 with XLA's
#                                              # norms), profiled; then in-scan k8 packed/fp8 alone
#   bash scripts/gpu_fast_llm.sh kernels-check OUT  # the same without the encoder rows
#   bash scripts/gpu_fast_llm.sh mlp OUT       # the fp8 MLP's pieces (bench_fp8_mlp.py), then the encoder stage
#   bash scripts/gpu_fast_llm.sh fidelity OUT  # HLO report, fp8 fidelity at the 4B shape, then the restart stage
#   bash scripts/gpu_fast_llm.sh table OUT     # bench_train --table: the table in one call
#   bash scripts/gpu_fast_llm.sh passes OUT    # in-scan k8 packed/fp8 with the two pass sizes, with the six of
#                                              # before, and with two again: compiled in parallel, timed in turn
#   bash scripts/gpu_fast_llm.sh passes-encoder OUT  # the encoder alone, fp8, both pass sizings at 128 and 132 prompts,
#                                              # profiled; then 128 prompts with XLA's command buffers off
#   bash scripts/gpu_fast_llm.sh update-flags OUT  # in-scan k8 packed/fp8 with XLA's default command buffers, with
#                                              # while loops and conditionals in them too, and with none; each row
#                                              # also traces an update without LLM windows (GPU vs wall time)
#   bash scripts/gpu_fast_llm.sh restart OUT   # rl.train fp8 twice: first update cold, then from the compile cache
# Every step is bounded by `timeout` and its output teed to OUT as it comes.
set -uo pipefail
stage=${1:?stage: kernels, kernels-check, encoder, mlp, fidelity, table, passes, passes-encoder, update-flags or restart}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...: run CMD under timeout, teeing to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
kernel_tests() {  # the fp8 kernels and cuDNN packed attention, compiled, against their XLA forms
  step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_llm_fp8.py tests/test_llm_packed.py \
    -k "compiled or one_pass or pallas or stays_close or cudnn"
}
k8_fp8_train() {  # in-scan k8 packed/fp8 alone
  step train 240 python3 scripts/bench_train.py --only inscan-128-k8 --llm-variants packed/fp8 --updates 6 \
    --out "$out/train.json"
}
k8_fp8_variants() {  # k8_fp8_variants NAME ARGS0 ARGS1 ARGS2 [FLAGS0 FLAGS1 FLAGS2]: in-scan k8 packed/fp8 in three
  # bench_train processes (extra arguments ARGSi, XLA_FLAGS plus FLAGSi), compiled together, timed one after another
  local name=$1 sync t0=$SECONDS; sync=$(mktemp -d)
  local -a extra=("$2" "$3" "$4") flags=("${5:-}" "${6:-}" "${7:-}")
  for rank in 0 1 2; do
    echo "rank $rank: ${extra[$rank]:-(no extra arguments)}, XLA_FLAGS += ${flags[$rank]:-(nothing)}"
    (
      xla_flags=$(echo "${XLA_FLAGS:-} ${flags[$rank]}" | xargs)  # never blank: XLA reads a blank value as a file name
      if [ -n "$xla_flags" ]; then export XLA_FLAGS="$xla_flags"; else unset XLA_FLAGS; fi
      timeout 570 python3 scripts/bench_train.py --only inscan-128-k8 --llm-variants packed/fp8 --updates 6 \
        ${extra[$rank]} --profile "/tmp/${name}_trace_$rank" --sync-dir "$sync" --sync-rank $rank --sync-world 3 \
        --out "$out/${name}_$rank.json" > "$out/${name}_$rank.log" 2>&1
      echo "rank $rank: exit $? after $((SECONDS - t0)) s"
      touch "$sync/ready.$rank" "$sync/done.$rank"  # a process that crashed must not hold the others up
    ) &
  done
  while [ -n "$(jobs -r)" ]; do sleep 20; echo "--- $((SECONDS - t0)) s"; tail -qn 1 "$out/${name}"_*.log; done
  wait
  grep -h "update without" "$out/${name}"_*.log; tail -n 3 "$out/${name}"_*.log
}
case $stage in
  encoder)
    step hlo 150 python3 scripts/fp8_hlo_report.py --out "$out/hlo.json"
    step encoder 330 python3 scripts/bench_encoder.py --ragged --batch 128 --methods packed \
      --dtypes bfloat16 fp8 fp8-xla-swiglu --iters 5 --profile /tmp/encoder_trace --out "$out/encoder.json"
    ;;
  kernels-check)  # the GPU tests and the trainer row only
    kernel_tests; k8_fp8_train
    ;;
  kernels)  # ~9.5 minutes at most: the tests took 125 s, the encoder 167-183 s, the trainer row 215-234 s
    kernel_tests
    step encoder 200 python3 scripts/bench_encoder.py --ragged --batch 128 --methods packed \
      --dtypes bfloat16 fp8 fp8-xla-norms --iters 5 --no-hf --profile /tmp/encoder_trace --out "$out/encoder.json"
    k8_fp8_train
    ;;
  mlp)
    step fp8_mlp 150 python3 scripts/bench_fp8_mlp.py --out "$out/fp8_mlp.json"
    step encoder 330 python3 scripts/bench_encoder.py --ragged --batch 128 --methods packed \
      --dtypes bfloat16 fp8 fp8-xla-swiglu --iters 5 --profile /tmp/encoder_trace --out "$out/encoder.json"
    ;;
  fidelity)  # with the fp8 HLO report and the compile-cache restart: one call
    step hlo 100 python3 scripts/fp8_hlo_report.py --out "$out/hlo.json"
    step fidelity 200 python3 scripts/fp8_fidelity.py --model qwen3-4b --out "$out/fidelity.json"
    bash "$0" restart "$out"
    ;;
  passes)  # the two sizes, the six of before, the two again
    k8_fp8_variants passes "" --six-pass-sizes ""
    ;;
  update-flags)
    k8_fp8_variants flags "" "" "" "" \
      "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
      "--xla_gpu_enable_command_buffer="
    ;;
  passes-encoder)
    for b in 128 132; do
      step "encoder_$b" 200 python3 scripts/bench_encoder.py --ragged --batch $b --methods packed packed-six \
        --dtypes fp8 --iters 5 --no-hf --no-gemm-ceiling --profile "/tmp/encoder_trace_$b" --out "$out/encoder_$b.json"
    done
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" step encoder_128_no_command_buffers 150 \
      python3 scripts/bench_encoder.py --ragged --batch 128 --methods packed packed-six --dtypes fp8 --iters 5 \
      --no-hf --no-gemm-ceiling --out "$out/encoder_128_no_command_buffers.json"
    ;;
  table)
    step table 585 python3 scripts/bench_train.py --table --out "$out/table.json"
    ;;
  restart)
    for run in cold warm; do
      step "restart_$run" $([ $run = cold ] && echo 330 || echo 150) python3 -m rl.train --encoder inscan --model qwen3-4b --llm-dtype fp8 --num-envs 128 \
        --skip-n 8 --max-updates 2 --quiet --compile-cache /tmp/jax_cache --run-dir "/tmp/restart_$run"
      python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print('first update s:', r[0]['seconds'])" \
        "/tmp/restart_$run/metrics.jsonl" | tee -a "$out/restart.log"
    done
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac

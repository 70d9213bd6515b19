#!/usr/bin/env bash
# Issue 35 item 1 in one device call (~7-8 minutes on an H100): plain PPO as a user runs it (`python -m rl.train`, SPS
# from its own metrics.jsonl) beside the upstream ppo.py and the in-process harness, at 1,024 envs (optimistic resets)
# and 128 envs (auto-reset), plus the launch-reducing candidates of rl.config.SpeedConfig as rl.train runs beside the
# default (same results, other kernels):
#   lazy         --lazy-reset true    a step draws its fresh worlds only when an env finished (lax.cond; 128 envs
#                                     only: at 1,024 envs some env finishes on ~97% of steps)
#   batch        --batch-resets true  the rollout's fresh worlds drawn in one batched call before its scan (1,024
#                                     envs only: 4,096 worlds at once; 128 auto-reset envs would hold 8,192)
#   unroll12     --env-unroll 12      Craftax's inner scans (mob slots etc., <= 12 steps) fully unrolled
#   cmdbuf       --trainer-xla ...    XLA command buffers (CUDA graphs) that also take while loops and conditionals
#   lazy_cmdbuf  both (128 envs): the lazy draw's conditional runs inside a command buffer, no host round trip
#   unroll12_batch (1,024 envs), unroll12_lazy (128 envs): the structural candidates together
# Everything compiles first, in parallel (rl.train runs into one persistent compilation cache), then each timing runs
# alone on the card. The upstream checkout is not in git: carry it (`.reference/Craftax_Baselines`, an ignored folder;
# git clone --depth 1 https://github.com/MichaelTMatthews/Craftax_Baselines .reference/Craftax_Baselines).
#
#   bash scripts/gpu_plain.sh OUT                     # device call; carry .reference/Craftax_Baselines
#   GPU_PLAIN_TINY=1 bash scripts/gpu_plain.sh OUT    # CPU check of this script's logic at tiny shapes (minutes)
#
# OUT gets: gpu.txt, table.log (progress and the two tables), table.json (every number, the rl.train records'
# seconds included), rl_train/ (each rl.train run's log and metrics.jsonl; not its checkpoints).
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
t0=$SECONDS
say() { echo "[gpu_plain +$((SECONDS - t0))s] $*" | tee -a "$out/progress.txt"; }
tiny=${GPU_PLAIN_TINY:-0}
ref_dir=${REFERENCE_DIR:-.reference/Craftax_Baselines}
runs=${GPU_PLAIN_RUNS:-/tmp/gpu_plain_runs}   # rl.train run directories (checkpoints: not under OUT)
rm -rf "$runs"
cmdbuf="xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
one=none-1024 few=none-128-autoreset
# timed in this order within each config (the most promising first: a run cut short by its limit loses the last)
variants=("lazy@$few=--lazy-reset true" "unroll12=--env-unroll 12" "unroll12_lazy@$few=--env-unroll 12 --lazy-reset true"
          "batch@$one=--batch-resets true" "unroll12_batch@$one=--env-unroll 12 --batch-resets true"
          "lazy_cmdbuf@$few=--lazy-reset true --trainer-xla $cmdbuf" "cmdbuf@$one=--trainer-xla $cmdbuf")

if [ "$tiny" = 1 ]; then  # CPU: the project's venv, Classic at 8 envs, one timed update per loop
  py=${PYTHON:-python3}
  sizes=(--smoke --updates 1 --repeats 1 --train-updates 4 --train-skip 1 --warm-workers 2 --compile-threads 2)
  limit=${GPU_PLAIN_LIMIT:-900}
else
  source "$(ls -d shared ../shared 2>/dev/null | head -1)/device/setup.sh" || exit 1
  py=python3
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  sizes=(--updates 5 --repeats 2 --train-updates 10 --train-skip 3 --warm-workers 5 --compile-threads 4)
  limit=${GPU_PLAIN_LIMIT:-570}
fi
reference=(--reference-dir "$ref_dir")
if [ ! -f "$ref_dir/ppo.py" ]; then
  say "WARNING: no $ref_dir/ppo.py (carry .reference/Craftax_Baselines): timing this trainer without ppo.py"
  reference=(--skip-reference)
fi

say "table: ppo.py, harness, rl.train records at 1,024 and 128 (auto-reset) envs + ${#variants[@]} candidates (limit ${limit}s)"
timeout "$limit" "$py" scripts/bench_reference.py "${reference[@]}" --only none-1024 none-128-autoreset "${sizes[@]}" \
  --rl-train --train-dir "$runs" --train-timeout 300 --variants "${variants[@]}" --out "$out/table.json" \
  2>&1 | tee "$out/table.log"
rc=${PIPESTATUS[0]}
say "bench_reference exited with $rc (124: ran out of its ${limit}s; table.json keeps the rows finished)"

mkdir -p "$out/rl_train"  # the rl.train runs' logs and records, never their checkpoints
for d in "$runs"/*; do
  [ -e "$d" ] || continue
  name=$(basename "$d")
  case "$name" in
    *.log) cp "$d" "$out/rl_train/" ;;
    compile_cache) ;;
    *) [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$out/rl_train/$name.metrics.jsonl" ;;
  esac
done
say "done; rl.train logs in $out/rl_train"
exit "$rc"

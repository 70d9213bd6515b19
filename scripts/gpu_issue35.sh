#!/usr/bin/env bash
# Issue 35 items 2 and 3 on one H100, one stage per device call (each ~8 minutes at most):
#   bash scripts/gpu_issue35.sh coldstart OUT   # rl.train 4B in-scan k8, 128 envs, bf16 then fp8: a cold compile
#                                               # cache, then the warm one; seconds from process start to the first
#                                               # status line ([update 1/...]) -> OUT/coldstart.txt
#   bash scripts/gpu_issue35.sh autotune OUT    # rl.train 4B fp8 cold, 6 updates, with XLA's GEMM autotuning at the
#                                               # LLM programs' level 2 (jaxllm.compile) and at XLA's default 4
#                                               # (XLA_FLAGS): first status line and the steady update seconds of
#                                               # each -> OUT/autotune.txt (ISSUE35_LEVELS="2 4 0" adds level 0)
#   bash scripts/gpu_issue35.sh probe-bf16 OUT  # a 1-update 4B bf16 run (16 envs x 16 steps), then the whole default
#   bash scripts/gpu_issue35.sh probe-fp8 OUT   # rl.probe on it (it prints its own load-excluded time) -> OUT/probe.txt
# One call can take both stages of one dtype (the probe reads the coldstart's cold run):
#   ISSUE35_DTYPES=fp8 ISSUE35_COLD_LIMIT=160 ISSUE35_WARM_LIMIT=80 ISSUE35_PROBE_LIMIT=300 \
#     bash -c 'bash scripts/gpu_issue35.sh coldstart OUT; bash scripts/gpu_issue35.sh probe-fp8 OUT'
# ISSUE35_WHEELS=DIR runs them on the wheels in DIR first on PYTHONPATH (below). Every step is bounded by `timeout`, its output teed to OUT as it comes, each line stamped with the seconds since
# its process started. ISSUE35_CPU=1 runs the same logic on a CPU with the tiny model (--preset test, a small probe,
# float32 unless ISSUE35_DTYPES says otherwise, limits x ISSUE35_LIMIT_SCALE): the script's own test.
set -uo pipefail
stage=${1:?stage: coldstart | autotune | probe-bf16 | probe-fp8}
out=${2:?output directory}
mkdir -p "$out"
if [ "${ISSUE35_CPU:-0}" = 1 ]; then
  model=tiny; size=(--preset test); probe_size=(--pairs 4 --play-steps 16); tmp=${ISSUE35_TMP:-$out/tmp}
  dtypes=(${ISSUE35_DTYPES:-float32 float32})
  scale=${ISSUE35_LIMIT_SCALE:-3}; cold_limit=$((240 * scale)); warm_limit=$((120 * scale)); probe_limit=$((330 * scale))
else
  source "$(ls -d shared ../shared 2>/dev/null | head -1)/device/setup.sh"
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
  model=qwen3-4b; size=(--num-envs 128 --skip-n 8); probe_size=(); tmp=${ISSUE35_TMP:-/tmp/issue35}
  dtypes=(${ISSUE35_DTYPES:-bfloat16 fp8})
  cold_limit=${ISSUE35_COLD_LIMIT:-240}; warm_limit=${ISSUE35_WARM_LIMIT:-120}; probe_limit=${ISSUE35_PROBE_LIMIT:-330}
fi
mkdir -p "$tmp"
# ISSUE35_WHEELS=DIR: the wheels there (e.g. the transformers a user's `pip install -e .` resolves today, with its
# tokenizers and huggingface_hub) go into a folder of their own, put first on PYTHONPATH for these runs only
if [ -n "${ISSUE35_WHEELS:-}" ]; then
  rm -rf "$tmp/userpkgs"
  python3 -m pip install -q --no-deps --target "$tmp/userpkgs" "$ISSUE35_WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH="$tmp/userpkgs:${PYTHONPATH:-}"
  python3 -c 'import sys, transformers, tokenizers, huggingface_hub
import transformers.utils
print("runs use transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "hub",
      huggingface_hub.__version__, "| torch imported by transformers.utils:", "torch" in sys.modules)' \
    | tee -a "$out/gpu.txt"
fi
# ISSUE35_LOG_COMPILES=1: JAX logs every compile with its seconds (which program a cold start waits for); the
# summary lists those over 2 s
[ "${ISSUE35_LOG_COMPILES:-0}" = 1 ] && export JAX_LOG_COMPILES=1

# stamp START: each stdin line prefixed with the seconds since START (a `date +%s.%N`), as it comes
stamp() { python3 -u -c 'import sys, time
start = float(sys.argv[1])
for line in iter(sys.stdin.readline, ""):
    sys.stdout.write(f"{time.time() - start:7.1f}s {line}")
    sys.stdout.flush()' "$1"; }

# step NAME LIMIT CMD...: run CMD under `timeout LIMIT`, stamped, teed to OUT/NAME.log; its exit status
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  local start; start=$(date +%s.%N)
  timeout "$limit" "$@" 2>&1 | stamp "$start" | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "== $name: exit status $rc$([ "$rc" = 124 ] && echo " (hit its ${limit}s limit)")"
  return "$rc"
}

# first_status NAME: the stamp of NAME's first status line ("[update 1/...]"), or "none"
first_status() { local t; t=$(grep -m1 -F '[update 1/' "$out/$1.log" | awk '{print $1}'); echo "${t:-none}"; }

# steady RUN_DIR: the median seconds of the run's updates after the first two (metrics.jsonl)
steady() { python3 -c 'import json, statistics, sys
seconds = [json.loads(line)["seconds"] for line in open(sys.argv[1])][2:]
print("%.2f s per update over %d" % (statistics.median(seconds), len(seconds)) if seconds else "no steady updates")' \
  "$1/metrics.jsonl" 2>/dev/null || echo "no metrics"; }

case $stage in
  coldstart)
    for dtype in "${dtypes[@]}"; do
      cache="$tmp/cache-$dtype"
      rm -rf "$cache" "$tmp/run-$dtype-cold" "$tmp/run-$dtype-warm"
      for run in cold warm; do
        limit=$([ $run = cold ] && echo $cold_limit || echo $warm_limit)
        step "coldstart_${dtype}_$run" "$limit" python3 -u -m rl.train --encoder inscan --model "$model" "${size[@]}" \
          --llm-dtype "$dtype" --max-updates 3 --compile-cache "$cache" --run-dir "$tmp/run-$dtype-$run"
        line="$dtype $run: first status line at $(first_status "coldstart_${dtype}_$run") (from process start)"
        echo "$line" | tee -a "$out/coldstart.txt"
      done
    done
    cat "$out/coldstart.txt"
    if [ "${ISSUE35_LOG_COMPILES:-0}" = 1 ]; then
      for log in "$out"/coldstart_*_cold.log; do
        echo "$log: compiles over 2 s"
        grep -o 'Finished XLA compilation of .* in [0-9.e-]* sec' "$log" | awk '$(NF-1)+0 > 2' | tee -a "$out/compiles.txt"
      done
    fi
    ;;
  autotune)  # each run cold (its own new cache directory): the LLM programs' level 2 (jaxllm.compile) vs XLA's 4
    dtype=${dtypes[-1]}
    for level in ${ISSUE35_LEVELS:-2 4}; do
      rm -rf "$tmp/cache-autotune-$level" "$tmp/run-autotune-$level"
      flags="${XLA_FLAGS:-}"; [ "$level" = 2 ] || flags="$flags --xla_gpu_autotune_level=$level"
      XLA_FLAGS="$flags" step "autotune_$level" "$cold_limit" \
        python3 -u -m rl.train --encoder inscan --model "$model" "${size[@]}" --llm-dtype "$dtype" --max-updates 6 \
        --compile-cache "$tmp/cache-autotune-$level" --run-dir "$tmp/run-autotune-$level"
      echo "$dtype autotune level $level: first status line at $(first_status "autotune_$level"); steady" \
        "$(steady "$tmp/run-autotune-$level")" | tee -a "$out/autotune.txt"
    done
    ;;
  probe-bf16|probe-fp8)
    dtype=${stage#probe-}; dtype=${dtype/bf16/bfloat16}
    [ "${ISSUE35_CPU:-0}" = 1 ] && dtype=${dtypes[0]}
    run="$tmp/probe-run-$dtype"
    if [ -f "$tmp/run-$dtype-cold/metrics.jsonl" ]; then  # the coldstart stage's run, on a machine still warm
      run="$tmp/run-$dtype-cold"
    else
      rm -rf "$run"
      # the probe reads the run's settings (model, dtype, skip_n, network); 1 short update is enough to write them
      if [ "${ISSUE35_CPU:-0}" = 1 ]; then train_size=(--preset test); else train_size=(--num-envs 16 --num-steps 16 --skip-n 8); fi
      step "probe_train_$dtype" "$cold_limit" python3 -u -m rl.train --encoder inscan --model "$model" "${train_size[@]}" \
        --llm-dtype "$dtype" --max-updates 1 --compile-cache "$tmp/cache-probe" --run-dir "$run" || exit 1
    fi
    step "probe_$dtype" "$probe_limit" python3 -u -m rl.probe "$run" "${probe_size[@]}" --out "$out/probe-$dtype" \
      --compile-cache "$tmp/cache-probe"
    echo "$dtype: $(grep -m1 -o 'probe done in .*' "$out/probe_$dtype.log" || echo 'probe did not finish')" \
      | tee -a "$out/probe.txt"
    ;;
  *) echo "unknown stage $stage (coldstart | autotune | probe-bf16 | probe-fp8)"; exit 2 ;;
esac

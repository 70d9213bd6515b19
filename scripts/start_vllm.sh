#!/usr/bin/env bash
# Start stock vLLM so that POST /v1/embeddings returns the raw final hidden state of the LAST prompt token
# (HF hidden_states[-1]: after the final RMSNorm, no L2 normalisation) for token-id inputs.
#
#   scripts/start_vllm.sh [MODEL] [-- extra vllm serve flags]
#   MODEL: hub id or local checkpoint dir (default Qwen/Qwen3-4B)
#   env:   HOST (default 127.0.0.1: loopback only), PORT (default 8000), DTYPE (default bfloat16),
#          MAX_MODEL_LEN (default 4096), VLLM_FLAG_STYLE (auto | runner | task; default auto),
#          POOLER_CONFIG (JSON; default chosen by version, see below)
#   then:  VLLM_URL=http://127.0.0.1:8000 VLLM_MODEL=<MODEL> python -m pytest -rs tests/parity/test_parity_vllm.py
#
# Flag spellings differ across vLLM releases (checked against vLLM's docs and pull requests):
#   vLLM <= 0.10.0          --task embed                --override-pooler-config '{"pooling_type":"LAST","normalize":false}'
#   0.10.1 <= vLLM < 0.11   --runner pooling --convert embed  (PR 21470)  --override-pooler-config (same JSON)
#   vLLM >= 0.11            --runner pooling --convert embed  --pooler-config (PR 25181 deprecated --override-pooler-config)
#   vLLM >= 0.15            pooler JSON key "use_activation": false replaces "normalize": false (PR 32243, merged
#                           2026-01; "normalize" stays accepted with a deprecation warning for a while). Set
#                           POOLER_CONFIG yourself if your release disagrees; none of this was run here (no vLLM).
# `--runner pooling` alone would use the model's default embed pooler, which L2-normalises: the pooler config is what
# makes the vector the raw hidden state. The parity test fails loudly if the vectors it gets have unit norm.
set -euo pipefail

MODEL="${1:-Qwen/Qwen3-4B}"
shift || true
[[ "${1:-}" == "--" ]] && shift
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
DTYPE="${DTYPE:-bfloat16}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"

if ! command -v vllm >/dev/null 2>&1; then
  echo "start_vllm.sh: 'vllm' is not on PATH; install it on a CUDA machine (pip install vllm) and retry" >&2
  exit 1
fi
VERSION="$(python -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo 0)"

# version_ge A B: true when version A >= B (numeric major.minor.patch; dev/rc suffixes ignored).
version_ge() {
  python - "$1" "$2" <<'PY'
import re, sys
def parse(v):
    return tuple(int(x) for x in (re.findall(r"\d+", v) + ["0", "0", "0"])[:3])
sys.exit(0 if parse(sys.argv[1]) >= parse(sys.argv[2]) else 1)
PY
}

STYLE="${VLLM_FLAG_STYLE:-auto}"
if [[ "$STYLE" == auto ]]; then
  if version_ge "$VERSION" 0.10.1; then STYLE=runner; else STYLE=task; fi
fi
if version_ge "$VERSION" 0.15.0; then
  DEFAULT_POOLER='{"pooling_type":"LAST","use_activation":false}'
else
  DEFAULT_POOLER='{"pooling_type":"LAST","normalize":false}'
fi
POOLER_CONFIG="${POOLER_CONFIG:-$DEFAULT_POOLER}"

if [[ "$STYLE" == runner ]]; then
  MODE_FLAGS=(--runner pooling --convert embed)
else
  MODE_FLAGS=(--task embed)
fi
if version_ge "$VERSION" 0.11.0; then
  POOLER_FLAG=--pooler-config
else
  POOLER_FLAG=--override-pooler-config
fi

CMD=(vllm serve "$MODEL" "${MODE_FLAGS[@]}" "$POOLER_FLAG" "$POOLER_CONFIG"
     --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" --host "$HOST" --port "$PORT" "$@")
echo "start_vllm.sh: vLLM $VERSION: ${CMD[*]}" >&2
exec "${CMD[@]}"

#!/usr/bin/env bash
# GPU check for rollout=vllm (one CUDA GPU, no downloads besides `pip install .[vllm]`).
#   bash scripts/gpu_check.sh                 # writes docs/gpu/vllm_check.json
#   OUT=/tmp/x bash scripts/gpu_check.sh      # writes /tmp/x/vllm_check.json
#   bash scripts/gpu_check.sh --no-trainer-smoke --enforce-eager   # quicker
# Extra arguments go to scripts/gpu_check.py (see --help). See docs/gpu/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "[gpu_check] vllm is not importable: pip install -e '.[vllm]'"
    if ! "$PY" -m pip install -e '.[vllm]'; then
        echo "[gpu_check] installing vllm failed; running anyway (the report will show the vLLM stages failing)"
    fi
fi

if [ -n "${OUT:-}" ]; then
    out="$OUT/vllm_check.json"
else
    out="docs/gpu/vllm_check.json"
fi
exec "$PY" scripts/gpu_check.py --out "$out" "$@"

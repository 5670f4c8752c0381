#!/usr/bin/env bash
# Example: convert a Hugging Face Qwen3 folder to a Megatron (legacy torch format) checkpoint
# with tp=2, pp=1, and back. Same flags as MindSpeed-LLM's convert_ckpt_v2.py; no torch needed.
#   bash scripts/convert_ckpt.sh HF_DIR MG_DIR [extra ms-llm convert flags ...]
# Environment: MODEL_TYPE_HF (qwen3), TP (2), PP (1), EP (1), PYTHON (python3).
# Exits non-zero (2) with a one-line message on bad input; output folders are complete or absent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 2 ]]; then
  echo "usage: convert_ckpt.sh HF_DIR MG_DIR [ms-llm convert flags ...]" >&2
  exit 2
fi
HF_DIR="$1"; MG_DIR="$2"; shift 2
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if ! "$PY" -c "import ms_llm, numpy, ml_dtypes" 2>/dev/null; then
  echo "convert_ckpt.sh: ms_llm's dependencies are not importable by $PY; run 'pip install -e .' or set PYTHON" >&2
  exit 2
fi

# HF -> Megatron
"$PY" -m ms_llm.cli convert \
  --load-model-type hf --save-model-type mg \
  --model-type-hf "${MODEL_TYPE_HF:-qwen3}" \
  --load-dir "$HF_DIR" --save-dir "$MG_DIR" \
  --target-tensor-parallel-size "${TP:-2}" \
  --target-pipeline-parallel-size "${PP:-1}" \
  --target-expert-parallel-size "${EP:-1}" \
  "$@"

# Megatron -> HF (round trip check of the example; config.json travels with the checkpoint)
"$PY" -m ms_llm.cli convert \
  --load-model-type mg --save-model-type hf \
  --load-dir "$MG_DIR" --save-dir "${MG_DIR%/}_to_hf"

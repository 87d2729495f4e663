#!/bin/bash
# Convert Hugging Face Qwen3-8B weights into a Megatron checkpoint sharded for TP 4 x PP 1.
#
#   bash examples/qwen3/ckpt_convert_qwen3_hf2mcore.sh
#   DRY_RUN=1 bash examples/qwen3/ckpt_convert_qwen3_hf2mcore.sh   # check the flags only
#
# examples/qwen25/ckpt_convert_qwen25_hf2mcore.sh with the qwen3 family: every config.json field
# is checked against the qwen3 row (q/k norms, head_dim, no qkv bias, tied or not); a field the
# mapping does not know is refused by name. Needs about one bf16 copy of the model in memory (~17 GB).
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

export MODEL_TYPE_HF=qwen3
export HF_MODEL_DIR=${HF_MODEL_DIR:-./model_from_hf/qwen3-8b}                       # config.json + *.safetensors
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./model_weights/qwen3-8b-mcore-tp4pp1}        # the training's CKPT_LOAD_DIR
export RUN_NAME=${RUN_NAME:-ckpt_convert_qwen3_hf2mcore}

exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen25/ckpt_convert_qwen25_hf2mcore.sh" "$@"

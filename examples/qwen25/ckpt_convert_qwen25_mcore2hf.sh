#!/bin/bash
# Merge the fine-tuned Megatron checkpoint (any TP/PP) back into a Hugging Face Qwen2.5 model directory.
#
#   bash examples/qwen25/ckpt_convert_qwen25_mcore2hf.sh
#   DRY_RUN=1 bash examples/qwen25/ckpt_convert_qwen25_mcore2hf.sh   # check the flags only
#
# Reads the latest iteration of CKPT_LOAD_DIR (latest_checkpointed_iteration.txt); the TP/PP sizes are
# read from the checkpoint itself. The result loads with transformers' from_pretrained.
# PRINT_ARGS=1 prints the Python entry point and its arguments one per line (for tests/test_example_flags.py).
set -euo pipefail

# ------------------------------------------------------------------ paths (edit these)
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./ckpt/qwen2.5-7b-sft-pack}          # CKPT_SAVE_DIR of the training script
HF_SAVE_DIR=${HF_SAVE_DIR:-./model_weights/qwen2.5-7b-sft-pack-hf}  # must not exist or be empty
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}  # its tokenizer files are copied over
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-ckpt_convert_qwen25_mcore2hf}   # names the log file
MODEL_TYPE_HF=${MODEL_TYPE_HF:-qwen2}   # the family (convert_ckpt.py --model-type-hf)

CONVERT_ARGS=(
    --load-model-type mg
    --save-model-type hf
    --model-type-hf "$MODEL_TYPE_HF"
    --load-dir "$CKPT_LOAD_DIR"
    --save-dir "$HF_SAVE_DIR"
    --params-dtype bf16
    --tokenizer-dir "$TOKENIZER_PATH"
)

source "$(dirname "${BASH_SOURCE[0]}")/../common/launch_convert.bash"   # PRINT_ARGS, DRY_RUN, or convert

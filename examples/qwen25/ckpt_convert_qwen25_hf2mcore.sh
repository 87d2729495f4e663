#!/bin/bash
# Convert Hugging Face Qwen2.5-7B weights into a Megatron checkpoint sharded for TP 4 x PP 1.
#
#   bash examples/qwen25/ckpt_convert_qwen25_hf2mcore.sh
#   DRY_RUN=1 bash examples/qwen25/ckpt_convert_qwen25_hf2mcore.sh   # check the flags only
#
# The output is a "release" checkpoint that tune_qwen25_7b_4k_full_pack.sh loads with --load --finetune.
# It runs on CPU and needs about one copy of the model in memory (~30 GB for bf16 7B).
# PRINT_ARGS=1 prints the Python entry point and its arguments one per line (for tests/test_example_flags.py).
set -euo pipefail

# ------------------------------------------------------------------ paths (edit these)
HF_MODEL_DIR=${HF_MODEL_DIR:-./model_from_hf/qwen2.5-7b-instruct}   # config.json + *.safetensors
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./model_weights/qwen2.5-7b-mcore-tp4pp1}  # must not exist or be empty
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-ckpt_convert_qwen25_hf2mcore}   # names the log file
MODEL_TYPE_HF=${MODEL_TYPE_HF:-qwen2}   # the family (convert_ckpt.py --model-type-hf)

# Must equal TP/PP of tune_qwen25_7b_4k_full_pack.sh (convert_ckpt.py --load-model-type mg
# --save-model-type mg reshards an existing Megatron checkpoint if you change them later).
TP=${TP:-4}
PP=${PP:-1}
EP=${EP:-1}   # expert-parallel ranks (MoE models)

CONVERT_ARGS=(
    --load-model-type hf
    --save-model-type mg
    --model-type-hf "$MODEL_TYPE_HF"
    --load-dir "$HF_MODEL_DIR"
    --save-dir "$CKPT_SAVE_DIR"
    --target-tensor-parallel-size "$TP"
    --target-pipeline-parallel-size "$PP"
    --target-expert-parallel-size "$EP"
    --params-dtype bf16            # Qwen2.5 is published in bf16: no precision is lost
)

source "$(dirname "${BASH_SOURCE[0]}")/../common/launch_convert.bash"   # PRINT_ARGS, DRY_RUN, or convert

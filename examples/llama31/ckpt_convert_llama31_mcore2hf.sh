#!/bin/bash
# Merge the fine-tuned Llama-3.1 Megatron checkpoint (any TP/PP) back into a Hugging Face model directory.
#
#   bash examples/llama31/ckpt_convert_llama31_mcore2hf.sh
#   DRY_RUN=1 bash examples/llama31/ckpt_convert_llama31_mcore2hf.sh   # check the flags only
#
# examples/qwen25/ckpt_convert_qwen25_mcore2hf.sh with the llama family (rope_parameters llama3 written back).
# TOKENIZER_PATH: if preprocessing added tokens, give its P_tokenizer/ here: their trained rows are kept.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

export MODEL_TYPE_HF=llama
export CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./ckpt/llama-3.1-8b-instruct-sft-pack}           # the training's CKPT_SAVE_DIR
export HF_SAVE_DIR=${HF_SAVE_DIR:-./model_weights/llama-3.1-8b-instruct-sft-pack-hf}   # must not exist or be empty
export TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/llama-3.1-8b-instruct}
export RUN_NAME=${RUN_NAME:-ckpt_convert_llama31_mcore2hf}

exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen25/ckpt_convert_qwen25_mcore2hf.sh" "$@"

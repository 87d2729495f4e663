#!/bin/bash
# Convert Hugging Face Llama-3.1-8B-Instruct weights into a Megatron checkpoint sharded for TP 8 x PP 1.
#
#   bash examples/llama31/ckpt_convert_llama31_hf2mcore.sh
#   DRY_RUN=1 bash examples/llama31/ckpt_convert_llama31_hf2mcore.sh   # check the flags only
#
# examples/qwen25/ckpt_convert_qwen25_hf2mcore.sh with the llama family (MindSpeed-LLM's --model-type-hf llama2
# is accepted too): every config.json field is checked against the llama row (llama3 RoPE scaling, no biases,
# tied or not); a field the mapping does not know is refused by name. Needs about one bf16 copy of the model
# in memory (~16 GB).
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

export MODEL_TYPE_HF=llama
export TP=${TP:-8}   # must equal the training's
export PP=${PP:-1}
export HF_MODEL_DIR=${HF_MODEL_DIR:-./model_from_hf/llama-3.1-8b-instruct}                # config.json + *.safetensors
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./model_weights/llama-3.1-8b-instruct-mcore-tp8pp1}  # the training's CKPT_LOAD_DIR
export RUN_NAME=${RUN_NAME:-ckpt_convert_llama31_hf2mcore}

exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen25/ckpt_convert_qwen25_hf2mcore.sh" "$@"

#!/bin/bash
# Convert Hugging Face Qwen3-30B-A3B weights into a Megatron checkpoint sharded for TP 4 x PP 2 x EP 2.
#
#   bash examples/qwen3_moe/ckpt_convert_qwen3_moe_hf2mcore.sh
#   DRY_RUN=1 bash examples/qwen3_moe/ckpt_convert_qwen3_moe_hf2mcore.sh   # check the flags only
#
# examples/qwen25/ckpt_convert_qwen25_hf2mcore.sh with the qwen3_moe family: the router (mlp.gate) and
# every expert's gate/up/down projections map through the same weight map as the dense layers;
# num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, mlp_only_layers and
# decoder_sparse_step are read from config.json. Shared-expert families (Qwen2-MoE) are refused by name.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

export MODEL_TYPE_HF=qwen3_moe
export TP=${TP:-4}
export PP=${PP:-2}
export EP=${EP:-2}   # each expert-parallel rank's files hold its 64 experts (Megatron-LM's layout)
export HF_MODEL_DIR=${HF_MODEL_DIR:-./model_from_hf/qwen3-30b-a3b}                   # config.json + *.safetensors
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./model_weights/qwen3-30b-a3b-mcore-tp4pp2ep2}     # the training's CKPT_LOAD_DIR
export RUN_NAME=${RUN_NAME:-ckpt_convert_qwen3_moe_hf2mcore}

exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen25/ckpt_convert_qwen25_hf2mcore.sh" "$@"

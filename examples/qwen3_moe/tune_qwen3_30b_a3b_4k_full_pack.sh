#!/bin/bash
# Full-parameter SFT of Qwen3-30B-A3B (128 experts, top-8) on neat-packed 4k instruction data:
# two nodes of 8 GPUs, TP 4 (sequence parallel) x PP 2 x EP 2 (64 experts per rank), bf16.
#
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> \
#       bash examples/qwen3_moe/tune_qwen3_30b_a3b_4k_full_pack.sh        # run on every node
#   DRY_RUN=1 bash examples/qwen3_moe/tune_qwen3_30b_a3b_4k_full_pack.sh  # parse + validate the flags, no GPU needed
#
# The Qwen2.5 recipe (examples/qwen25/tune_qwen25_7b_4k_full_pack.sh: every hook and variable) with
# Qwen3-30B-A3B's model and MoE flags (qwen3_30b_a3b_model_args.bash) and the qwen3 chat template.
# The router sees samples, not packs: pads reach no expert and count in no routing statistic
# (README, "Mixture of experts"). Checkpoints are saved per TP x PP x EP rank (mp_rank_TT_PPP_EEE,
# as Megatron-LM), so the run resumes at the same EP; another EP loads the weights (--no-load-optim). Each of
# the 16 ranks holds about 1/16 of the ~30.5B parameters (the experts split 16 ways). Before: data_convert_qwen3_instruction_pack.sh
# (examples/qwen3/, SEQ_LEN 4096), then ckpt_convert_qwen3_moe_hf2mcore.sh, or CKPT_LOAD_DIR=<the HF
# model directory> to load it directly.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MODEL_ARGS_FILE=${MODEL_ARGS_FILE:-$HERE/qwen3_30b_a3b_model_args.bash}
export PROMPT_TYPE=${PROMPT_TYPE:-qwen3}   # must equal the data script's
export NNODES=${NNODES:-2}
export TP=${TP:-4}
export PP=${PP:-2}
export EP=${EP:-2}
export GBS=${GBS:-16}
export CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_weights/qwen3-30b-a3b-mcore-tp4pp2ep2}   # ckpt_convert_qwen3_moe_hf2mcore.sh
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen3-30b-a3b-sft-pack}
export DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen3-8b/alpaca}   # Qwen3 tokenizer: the qwen3 data script's packs
export TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen3-30b-a3b}
export RUN_NAME=${RUN_NAME:-tune_qwen3_30b_a3b_4k_full_pack}

exec bash "$HERE/../qwen25/tune_qwen25_7b_4k_full_pack.sh" "$@"

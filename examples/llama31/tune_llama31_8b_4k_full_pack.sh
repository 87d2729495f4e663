#!/bin/bash
# Full-parameter SFT of Llama-3.1-8B-Instruct on neat-packed 4k instruction data: TP 8 x PP 1, bf16.
#
#   bash examples/llama31/tune_llama31_8b_4k_full_pack.sh            # one node, 8 GPUs (TP 8 x DP 1)
#   DRY_RUN=1 bash examples/llama31/tune_llama31_8b_4k_full_pack.sh  # parse + validate the flags, no GPU needed
#
# The Qwen2.5 recipe (examples/qwen25/tune_qwen25_7b_4k_full_pack.sh: parallelism, schedule, data and
# checkpoint flags, every hook and variable) with Llama-3.1-8B's model flags (llama31_8b_model_args.bash), the
# llama3 chat template and MindSpeed-LLM's layout for it (tune_llama31_8b_4k_full_pack_ptd.sh: TP 8, PP 1,
# MBS 1, GBS 8). Before: data_convert_llama31_instruction_pack.sh, ckpt_convert_llama31_hf2mcore.sh (or
# CKPT_LOAD_DIR=<the HF model directory>: loaded directly); after: ckpt_convert_llama31_mcore2hf.sh.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MODEL_ARGS_FILE=${MODEL_ARGS_FILE:-$HERE/llama31_8b_model_args.bash}
export PROMPT_TYPE=${PROMPT_TYPE:-llama3}   # must equal the data script's
export TP=${TP:-8}                          # must equal the conversion's
export PP=${PP:-1}
export CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_weights/llama-3.1-8b-instruct-mcore-tp8pp1}   # ckpt_convert_llama31_hf2mcore.sh
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/llama-3.1-8b-instruct-sft-pack}
export DATA_PATH=${DATA_PATH:-./finetune_dataset/llama-3.1-8b-instruct/alpaca}   # --output-prefix of the data script
export TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/llama-3.1-8b-instruct}
export RUN_NAME=${RUN_NAME:-tune_llama31_8b_4k_full_pack}

exec bash "$HERE/../qwen25/tune_qwen25_7b_4k_full_pack.sh" "$@"

#!/bin/bash
# Full-parameter SFT of Qwen3-8B on neat-packed 4k instruction data: TP 4 x PP 1, bf16.
#
#   bash examples/qwen3/tune_qwen3_8b_4k_full_pack.sh            # one node, 8 GPUs (TP 4 x DP 2)
#   DRY_RUN=1 bash examples/qwen3/tune_qwen3_8b_4k_full_pack.sh  # parse + validate the flags, no GPU needed
#
# The Qwen2.5 recipe (examples/qwen25/tune_qwen25_7b_4k_full_pack.sh: parallelism, schedule, data and
# checkpoint flags, every hook and variable) with Qwen3-8B's model flags (qwen3_8b_model_args.bash) and
# the qwen3 chat template. Before: data_convert_qwen3_instruction_pack.sh, ckpt_convert_qwen3_hf2mcore.sh;
# after: ckpt_convert_qwen3_mcore2hf.sh.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MODEL_ARGS_FILE=${MODEL_ARGS_FILE:-$HERE/qwen3_8b_model_args.bash}
export PROMPT_TYPE=${PROMPT_TYPE:-qwen3}   # must equal the data script's
export CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_weights/qwen3-8b-mcore-tp4pp1}   # written by ckpt_convert_qwen3_hf2mcore.sh
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen3-8b-sft-pack}
export DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen3-8b/alpaca}              # --output-prefix of the data script
export TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen3-8b}
export RUN_NAME=${RUN_NAME:-tune_qwen3_8b_4k_full_pack}

exec bash "$HERE/../qwen25/tune_qwen25_7b_4k_full_pack.sh" "$@"

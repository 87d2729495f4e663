#!/bin/bash
# Tokenize an instruction dataset with the qwen3 chat template and neat-pack it into 4k packs.
#
#   bash examples/qwen3/data_convert_qwen3_instruction_pack.sh
#   DRY_RUN=1 bash examples/qwen3/data_convert_qwen3_instruction_pack.sh   # check the flags only
#
# examples/qwen25/data_convert_qwen25_instruction_pack.sh (same variables: INPUT, HANDLER, MAP_KEYS,
# SEQ_LEN, PAD_MULTIPLE, ...) with Qwen3's tokenizer and the qwen3 template of
# configs/finetune/templates.json: Qwen3's turns without reasoning, no default system prompt.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

export PROMPT_TYPE=${PROMPT_TYPE:-qwen3}   # must equal the training's
export TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen3-8b}
export OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/qwen3-8b/alpaca}   # the training's DATA_PATH
export RUN_NAME=${RUN_NAME:-data_convert_qwen3_instruction_pack}

exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen25/data_convert_qwen25_instruction_pack.sh" "$@"

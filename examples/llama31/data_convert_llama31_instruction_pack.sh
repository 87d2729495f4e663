#!/bin/bash
# Tokenize an instruction dataset with the llama3 chat template and neat-pack it into 4k packs.
#
#   bash examples/llama31/data_convert_llama31_instruction_pack.sh
#   DRY_RUN=1 bash examples/llama31/data_convert_llama31_instruction_pack.sh   # check the flags only
#
# examples/qwen25/data_convert_qwen25_instruction_pack.sh (same variables: INPUT, HANDLER, MAP_KEYS,
# SEQ_LEN, PAD_MULTIPLE, ...) with Llama-3.1's tokenizer and the llama3 template of
# configs/finetune/templates.json (MindSpeed-LLM's --prompt-type llama3). Llama-3.1's own Jinja template adds a
# system header with "Cutting Knowledge Date" / "Today Date" to every conversation: to train on exactly that,
# use PROMPT_TYPE=hf (the tokenizer's template) here and in the tune script.
# PRINT_ARGS=1 (tests/test_example_flags.py) and DRY_RUN=1 work as in the script this one runs.
set -euo pipefail

export PROMPT_TYPE=${PROMPT_TYPE:-llama3}   # must equal the training's
export TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/llama-3.1-8b-instruct}
export OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/llama-3.1-8b-instruct/alpaca}   # the training's DATA_PATH
export RUN_NAME=${RUN_NAME:-data_convert_llama31_instruction_pack}

exec bash "$(dirname "${BASH_SOURCE[0]}")/../qwen25/data_convert_qwen25_instruction_pack.sh" "$@"

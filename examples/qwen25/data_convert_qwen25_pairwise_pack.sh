#!/bin/bash
# Tokenize preference pairs with the Qwen chat template and neat-pack them into 4k packs (a pair is the unit of
# packing: its chosen and rejected answers are segments 2k-1 and 2k of one pack), for the outcome reward model
# (tune_qwen25_7b_4k_orm_pack.sh) or DPO.
#
#   bash examples/qwen25/data_convert_qwen25_pairwise_pack.sh
#   DRY_RUN=1 bash examples/qwen25/data_convert_qwen25_pairwise_pack.sh   # check the flags only
#
# Rows: system, question, chosen, rejected (orca_rlhf's columns; MAP_KEYS renames them). A pair longer than
# SEQ_LEN is dropped and counted, never cut.
# PRINT_ARGS=1 prints the Python entry point and its arguments one per line (for tests/test_example_flags.py).
set -euo pipefail

# ------------------------------------------------------------------ paths (edit these)
INPUT=${INPUT:-./dataset/orca_rlhf/orca_rlhf.jsonl}   # a file, or a directory of them
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/qwen2.5-7b/pairs}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-data_convert_qwen25_pairwise_pack}   # names the log file

PROMPT_TYPE=${PROMPT_TYPE:-qwen}   # the training's --prompt-type
MAP_KEYS=${MAP_KEYS:-'{"prompt": "question", "system": "system", "chosen": "chosen", "rejected": "rejected"}'}
SEQ_LEN=${SEQ_LEN:-4096}   # must equal --seq-length of tune_qwen25_7b_4k_orm_pack.sh
WORKERS=${WORKERS:-8}

PREPROCESS_ARGS=(
    --input "$INPUT"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
    --output-prefix "$OUTPUT_PREFIX"
    --handler-name AlpacaStylePairwiseHandler
    --prompt-type "$PROMPT_TYPE"
    --map-keys "$MAP_KEYS"
    --seq-length "$SEQ_LEN"
    --pack
    --neat-pack
    --workers "$WORKERS"
    --log-interval 1000
)

source "$(dirname "${BASH_SOURCE[0]}")/../common/launch_preprocess.bash"   # PRINT_ARGS, DRY_RUN, then preprocess

#!/bin/bash
# Tokenize process reward rows (Math-Shepherd: 'input', a solution with a step tag after each step, and 'value',
# one + or - per step) and neat-pack them into 4k packs for tune_qwen25_7b_4k_prm_pack.sh.
#
#   bash examples/qwen25/data_convert_qwen25_process_reward_pack.sh
#   DRY_RUN=1 bash examples/qwen25/data_convert_qwen25_process_reward_pack.sh   # check the flags only
#
# The text is tokenised as written (no template, no EOS), as MindSpeed-LLM does; each step tag's label is its
# reward token's id. The tag must be one token as it stands in the text: a byte-level BPE tokenizer (Qwen) reads
# it with the space before it, hence ' ки' below. Preprocessing refuses a tag or reward token that is not one
# token, and a row whose tags merged with the text beside them (naming the row): then add the tag to the
# tokenizer as a special token.
# PRINT_ARGS=1 prints the Python entry point and its arguments one per line (for tests/test_example_flags.py).
set -euo pipefail

# ------------------------------------------------------------------ paths (edit these)
INPUT=${INPUT:-./dataset/math_shepherd/train-00000-of-00002.parquet}   # a file, or a directory of them
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/qwen2.5-7b/math_shepherd}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-data_convert_qwen25_process_reward_pack}   # names the log file

PLACEHOLDER=${PLACEHOLDER:- ки}   # the step tag as the text holds it (Math-Shepherd's, with its space)
SEQ_LEN=${SEQ_LEN:-4096}   # must equal --seq-length of tune_qwen25_7b_4k_prm_pack.sh
WORKERS=${WORKERS:-8}

PREPROCESS_ARGS=(
    --input "$INPUT"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
    --output-prefix "$OUTPUT_PREFIX"
    --handler-name AlpacaStyleProcessRewardHandler
    --placeholder-token "$PLACEHOLDER"
    --reward-tokens + -
    --seq-length "$SEQ_LEN"
    --pack
    --neat-pack
    --workers "$WORKERS"
    --log-interval 1000
)

source "$(dirname "${BASH_SOURCE[0]}")/../common/launch_preprocess.bash"   # PRINT_ARGS, DRY_RUN, then preprocess

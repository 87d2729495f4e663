#!/bin/bash
# Tokenize an instruction dataset with the Qwen chat template and neat-pack it into 4k packs.
#
#   bash examples/qwen25/data_convert_qwen25_instruction_pack.sh
#   DRY_RUN=1 bash examples/qwen25/data_convert_qwen25_instruction_pack.sh   # check the flags only
#
# Writes ${OUTPUT_PREFIX}_packed_{input_ids,attention_mask,labels}_document.{bin,idx} (+ _packed_meta.json);
# the training script reads them with --data-path ${OUTPUT_PREFIX}.
# ShareGPT data instead of Alpaca:
#   HANDLER=SharegptStyleInstructionHandler MAP_KEYS='{"messages": "conversations"}' bash ...
# 32k packs for context-parallel training: data_convert_qwen25_instruction_pack_32k_cp.sh (SEQ_LEN, PAD_MULTIPLE).
# One sample per document, packed at load time by training (dynamic CP): data_convert_qwen25_instruction_dynamic_cp.sh
# (PACK=0, SEQ_LEN = the longest sample).
# PRINT_ARGS=1 prints the Python entry point and its arguments one per line (for tests/test_example_flags.py).
set -euo pipefail

# ------------------------------------------------------------------ paths (edit these)
INPUT=${INPUT:-./dataset/alpaca/train-00000-of-00001-a09b74b3ef9c3b56.parquet}  # a file, or a directory of them
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/qwen2.5-7b/alpaca}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-data_convert_qwen25_instruction_pack}   # names the log file

HANDLER=${HANDLER:-AlpacaStyleInstructionHandler}
PROMPT_TYPE=${PROMPT_TYPE:-qwen}   # chat template (configs/finetune/templates.json); the training's --prompt-type
# Which input columns hold what; these are the Alpaca names, spelled out so renaming is one edit.
MAP_KEYS=${MAP_KEYS:-'{"prompt": "instruction", "query": "input", "response": "output"}'}
SEQ_LEN=${SEQ_LEN:-4096}   # must equal --seq-length of tune_qwen25_7b_4k_full_pack.sh
# Pad every sample to a multiple of this before packing (1 = off). For context parallelism:
# 2 x CP x TP of the training (it uses --sequence-parallel), so training adds no padding.
PAD_MULTIPLE=${PAD_MULTIPLE:-1}
ENABLE_THINKING=${ENABLE_THINKING:-}   # true/false: MindSpeed-LLM's --enable-thinking (unset: not passed)
WORKERS=${WORKERS:-8}
# 1: neat packs of SEQ_LEN tokens. 0: one sample per document (SEQ_LEN truncates), for training's online packing
# (--sequence-packing-scheduler dp_balanced / default_dynamic_cp).
PACK=${PACK:-1}

# --neat-pack stores each sample's segment id in attention_mask, so training isolates the samples of a
# pack. No --append-eod: the qwen template already ends every answer with <|im_end|> (the EOS).
PREPROCESS_ARGS=(
    --input "$INPUT"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
    --output-prefix "$OUTPUT_PREFIX"
    --handler-name "$HANDLER"
    --prompt-type "$PROMPT_TYPE"
    --map-keys "$MAP_KEYS"
    --seq-length "$SEQ_LEN"
    --pack
    --neat-pack
    --workers "$WORKERS"
    --log-interval 1000
)
if [[ "$PACK" != 1 ]]; then  # one sample per document: training packs at load time
    UNPACKED=()
    for arg in "${PREPROCESS_ARGS[@]}"; do
        [[ "$arg" == --pack || "$arg" == --neat-pack ]] || UNPACKED+=("$arg")
    done
    PREPROCESS_ARGS=("${UNPACKED[@]}")
fi
if (( PAD_MULTIPLE > 1 )); then
    PREPROCESS_ARGS+=(--pad-to-multiple-of "$PAD_MULTIPLE")
fi
if [[ -n "$ENABLE_THINKING" ]]; then
    PREPROCESS_ARGS+=(--enable-thinking "$ENABLE_THINKING")
fi

source "$(dirname "${BASH_SOURCE[0]}")/../common/launch_preprocess.bash"   # PRINT_ARGS, DRY_RUN, then preprocess

#!/bin/bash
# Tokenize a long-tailed instruction dataset with the Qwen chat template, one sample per document (no --pack),
# for dynamic context-parallel training (tune_qwen25_7b_dynamic_cp.sh), which packs every global batch at load
# time and puts each sample on the smallest CP group that holds it.
#
#   bash examples/qwen25/data_convert_qwen25_instruction_dynamic_cp.sh
#   DRY_RUN=1 bash examples/qwen25/data_convert_qwen25_instruction_dynamic_cp.sh   # check the flags only
#   PRINT_ARGS=1 bash examples/qwen25/data_convert_qwen25_instruction_dynamic_cp.sh
#
# A thin wrapper around data_convert_qwen25_instruction_pack.sh (input, tokenizer, handler, hooks): PACK=0
# and SEQ_LEN = the longest sample training takes, CP x MAX_SEQLEN_PER_RANK of the training script (longer
# answers are truncated here, at preprocessing, as every sample over --seq-length is). No padding: training
# pads each sample to what its own CP group needs.
set -euo pipefail

export PACK=0
export SEQ_LEN=${SEQ_LEN:-65536}   # must equal SEQ_LEN of tune_qwen25_7b_dynamic_cp.sh (= CP x MAX_SEQLEN_PER_RANK)
export OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/qwen2.5-7b/alpaca_64k_unpacked}   # the training's DATA_PATH
export RUN_NAME=${RUN_NAME:-data_convert_qwen25_instruction_dynamic_cp}                   # log file name

exec bash "$(dirname "${BASH_SOURCE[0]}")/data_convert_qwen25_instruction_pack.sh" "$@"

#!/bin/bash
# Tokenize an instruction dataset with the Qwen chat template and neat-pack it into 32k packs for
# context-parallel training (tune_qwen25_7b_32k_full_pack_cp.sh, TP 4 x CP 2).
#
#   bash examples/qwen25/data_convert_qwen25_instruction_pack_32k_cp.sh
#   DRY_RUN=1 bash examples/qwen25/data_convert_qwen25_instruction_pack_32k_cp.sh   # check the flags only
#   PRINT_ARGS=1 bash examples/qwen25/data_convert_qwen25_instruction_pack_32k_cp.sh
#
# A thin wrapper around data_convert_qwen25_instruction_pack.sh (input, tokenizer, handler, hooks):
# 32768-token packs, and every sample padded at its end to a multiple of 2 x CP x TP
# (--pad-to-multiple-of; x TP because training uses --sequence-parallel), so every sample splits
# into 2 x CP equal chunks, each divisible over TP, with no padding added at training time.
set -euo pipefail

export SEQ_LEN=${SEQ_LEN:-32768}   # must equal SEQ_LEN of tune_qwen25_7b_32k_full_pack_cp.sh
TP=${TP:-4}                        # the training's TP and CP
CP=${CP:-2}
export PAD_MULTIPLE=${PAD_MULTIPLE:-$((2 * CP * TP))}
export OUTPUT_PREFIX=${OUTPUT_PREFIX:-./finetune_dataset/qwen2.5-7b/alpaca_32k}   # the training's DATA_PATH
export RUN_NAME=${RUN_NAME:-data_convert_qwen25_instruction_pack_32k_cp}         # log file name

exec bash "$(dirname "${BASH_SOURCE[0]}")/data_convert_qwen25_instruction_pack.sh" "$@"

#!/bin/bash
# Full-parameter SFT of Qwen2.5-7B on a long-tailed instruction set (most samples a few hundred tokens, a few up
# to 64k) with dynamic context parallelism: TP 2 x CP up to 4 on 8 GPUs, bf16.
#
#   bash examples/qwen25/tune_qwen25_7b_dynamic_cp.sh            # one node, 8 GPUs (TP 2 x CP 4, DP 1)
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_dynamic_cp.sh  # parse + validate the flags; with the data
#                                                                # present, also the first steps' CP plans
#   PRINT_ARGS=1 bash examples/qwen25/tune_qwen25_7b_dynamic_cp.sh
#
# Before: data_convert_qwen25_instruction_dynamic_cp.sh (one sample per document, up to SEQ_LEN tokens)
#         ckpt_convert_qwen25_hf2mcore.sh with TP=2 CKPT_SAVE_DIR=./model_weights/qwen2.5-7b-mcore-tp2pp1
#         (or CKPT_LOAD_DIR=<the HF model directory>: each rank reads its own slice)
#
# A thin wrapper: it sets the values below and runs tune_qwen25_7b_4k_full_pack.sh, which holds the model,
# the recipe and every hook. --sequence-packing-scheduler default_dynamic_cp packs each global batch at load
# time: a sample of at most MAX_SEQLEN_PER_RANK tokens runs on one rank (packed best-fit with others into
# rows of that many tokens), one of at most 2x on a CP group of 2, up to CP x on CP ranks (zigzag split), and
# the ranks' estimated costs are balanced; short samples pay no CP communication and no zigzag padding.
# A sample over CP x MAX_SEQLEN_PER_RANK stops the run naming it (OVERRIDES can add --overlong-samples drop).
set -euo pipefail

export TP=${TP:-2}
export CP=${CP:-4}                                   # the largest CP group; the data x CP ranks are one pool
export MAX_SEQLEN_PER_RANK=${MAX_SEQLEN_PER_RANK:-16384}   # tokens per rank per micro-batch (activation memory)
export SEQ_LEN=${SEQ_LEN:-$((CP * MAX_SEQLEN_PER_RANK))}   # the longest sample: the data script's SEQ_LEN
export PACKING_SCHEDULER=default_dynamic_cp
# GBS counts samples (not packs): 32 samples of the long-tailed mix hold about as many tokens as the 4k recipe's
# 8 x 4096 packs, so its lr and schedule carry over. Any multiple of MBS x DP (DP = WORLD_SIZE / (TP x CP)).
export GBS=${GBS:-32}
export CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_weights/qwen2.5-7b-mcore-tp2pp1}
export DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen2.5-7b/alpaca_64k_unpacked}   # --output-prefix of the data script
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-sft-dynamic-cp}
export RUN_NAME=${RUN_NAME:-tune_qwen25_7b_dynamic_cp}   # tensorboard dir, metrics file, node logs

exec bash "$(dirname "${BASH_SOURCE[0]}")/tune_qwen25_7b_4k_full_pack.sh" "$@"

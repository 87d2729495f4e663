#!/bin/bash
# Full-parameter SFT of Qwen2.5-7B on neat-packed 32k instruction data with context parallelism:
# TP 4 x CP 2 (x PP 1) on one node of 8 GPUs, bf16.
#
#   bash examples/qwen25/tune_qwen25_7b_32k_full_pack_cp.sh            # one node, 8 GPUs (TP 4 x CP 2, DP 1)
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_32k_full_pack_cp.sh  # parse + validate the flags, no GPU needed
#   PRINT_ARGS=1 bash examples/qwen25/tune_qwen25_7b_32k_full_pack_cp.sh
#
# Before: data_convert_qwen25_instruction_pack_32k_cp.sh (32k packs, samples padded to 2 x CP x TP)
#         ckpt_convert_qwen25_hf2mcore.sh                 (the same TP 4 x PP 1 checkpoint as the 4k recipe)
#
# A thin wrapper: it sets the values below and runs tune_qwen25_7b_4k_full_pack.sh, which holds the
# model, the recipe and every hook (DRY_RUN, PRINT_ARGS, OVERRIDES, NNODES/NODE_RANK/MASTER_ADDR, paths).
# Each CP rank holds 16k of a pack's 32k tokens: every sample is cut into 2 x CP chunks and CP rank r
# keeps chunks r and 2CP-1-r, so causal attention work is the same on every rank
# (bench/bench_cp_balance.py). Any variable can still be overridden from the environment.
set -euo pipefail

export SEQ_LEN=${SEQ_LEN:-32768}   # must equal SEQ_LEN of data_convert_qwen25_instruction_pack_32k_cp.sh
export TP=${TP:-4}
export CP=${CP:-2}                 # TP x CP must also match PAD_MULTIPLE = 2 x CP x TP of the data script
# One 32k pack per step = 32768 tokens, as the 4k recipe's GBS 8 x 4096, so its lr and schedule carry over.
# With more nodes (data-parallel size WORLD_SIZE / (TP x CP) > 1) raise it to a multiple of that.
export GBS=${GBS:-1}
export DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen2.5-7b/alpaca_32k}   # --output-prefix of the data script
export CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-sft-pack-32k-cp}
export RUN_NAME=${RUN_NAME:-tune_qwen25_7b_32k_full_pack_cp}   # tensorboard dir, metrics file, node logs

exec bash "$(dirname "${BASH_SOURCE[0]}")/tune_qwen25_7b_4k_full_pack.sh" "$@"

#!/bin/bash
# ORPO of Qwen2.5-7B (the base model: SFT and preference in one stage) on neat-packed 4k preference pairs,
# TP 4 x DP 2, bf16, 8 GPUs, no reference model.
#
#   bash examples/qwen25/tune_qwen25_7b_4k_orpo_pack.sh
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_orpo_pack.sh   # parse + validate the flags, no GPU
#   PRINT_ARGS=1 bash examples/qwen25/tune_qwen25_7b_4k_orpo_pack.sh
#
# A thin wrapper: tune_qwen25_7b_4k_simpo_pack.sh with STAGE=orpo (--orpo-beta 0.1, lr 5e-6, the base
# model), which holds the model, the data flags and every hook. Same job: configs/orpo/qwen25_7b_4k_orpo_pack.yaml.
set -euo pipefail

export STAGE=orpo
exec bash "$(dirname "${BASH_SOURCE[0]}")/tune_qwen25_7b_4k_simpo_pack.sh" "$@"

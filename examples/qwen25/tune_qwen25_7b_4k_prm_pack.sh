#!/bin/bash
# Process reward model from Qwen2.5-7B on neat-packed 4k Math-Shepherd rows: at each step tag, a 2-way softmax
# over the logits of + and - (the LM head kept), cross entropy with the step's label; TP 4 x DP 2, bf16, 8 GPUs.
#
#   bash examples/qwen25/tune_qwen25_7b_4k_prm_pack.sh
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_prm_pack.sh   # parse + validate the flags, no GPU needed
#   PRINT_ARGS=1 bash examples/qwen25/tune_qwen25_7b_4k_prm_pack.sh
#
# A thin wrapper: tune_qwen25_7b_4k_orm_pack.sh with STAGE=prm (lr 2e-6, the Math-Shepherd packs of
# data_convert_qwen25_process_reward_pack.sh), which holds the model, the recipe and every hook.
# After: SAVE_HF_DIR=<new dir> writes a Qwen2ForCausalLM: a step's score is softmax(logits[tag, [+, -]])[0] at its tag.
set -euo pipefail

export STAGE=prm
exec bash "$(dirname "${BASH_SOURCE[0]}")/tune_qwen25_7b_4k_orm_pack.sh" "$@"

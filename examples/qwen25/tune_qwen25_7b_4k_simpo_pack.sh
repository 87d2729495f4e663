#!/bin/bash
# Reference-free preference training of Qwen2.5-7B on neat-packed 4k preference pairs: SimPO (default) or
# ORPO (STAGE=orpo; tune_qwen25_7b_4k_orpo_pack.sh sets it), TP 4 x DP 2, bf16, 8 GPUs, straight from the
# Hugging Face directory (each rank reads its own TP slice). No reference model is built or loaded, so a
# rank holds what SFT holds; the raw pairs are tokenised and packed first, once (a pair is the unit of
# packing: its chosen and rejected answers are segments 2k-1 and 2k of one pack).
#
#   bash examples/qwen25/tune_qwen25_7b_4k_simpo_pack.sh             # one node, 8 GPUs (TP 4 x DP 2)
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_simpo_pack.sh   # parse + validate the flags, no GPU
#
# SimPO: beta 2.5, gamma / beta 0.55 (the SimPO authors' setting for an instruct model; MindSpeed-LLM's
# defaults are 2.5 and 1.4), lr 1e-6, from the instruct model. ORPO: beta 0.1 (TRL's default), from the base
# model (ORPO does SFT and preference in one stage), lr 5e-6. README "Preference training" has the losses.
# Same job: configs/simpo/qwen25_7b_4k_simpo_pack.yaml. NNODES/NODE_RANK/MASTER_ADDR, OVERRIDES=file.sh and
# PRINT_ARGS=1 work as in tune_qwen25_7b_4k_full_pack.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export CUDA_DEVICE_MAX_CONNECTIONS=1

STAGE=${STAGE:-simpo}   # simpo or orpo
case "$STAGE" in
    simpo) PREF_ARGS=(--stage simpo --simpo-beta 2.5 --gamma-beta-ratio 0.55 --simpo-loss-type sigmoid)
           DEFAULT_LR=1e-6; DEFAULT_LOAD=./model_from_hf/qwen2.5-7b-instruct ;;
    orpo)  PREF_ARGS=(--stage orpo --orpo-beta 0.1)
           DEFAULT_LR=5e-6; DEFAULT_LOAD=./model_from_hf/qwen2.5-7b ;;
    *) echo "STAGE=$STAGE: this script trains simpo or orpo (DPO: configs/dpo/qwen25_7b_4k_dpo_pack.yaml)" >&2
       exit 1 ;;
esac

# ------------------------------------------------------------------ paths (edit these)
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-$DEFAULT_LOAD}   # a HF directory (or a Megatron checkpoint of TP 4)
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-$STAGE-pack}
SAVE_HF_DIR=${SAVE_HF_DIR:-}   # if set: the trained model as a HF directory when training ends (--save-hf)
DATA_PATH=${DATA_PATH:-./dataset/preference/pairs.jsonl}   # raw pairs: instruction, input, chosen, rejected
TOKENIZER_PATH=${TOKENIZER_PATH:-$CKPT_LOAD_DIR}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-tune_qwen25_7b_4k_${STAGE}_pack}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$LOG_DIR/tensorboard/$RUN_NAME}

# ------------------------------------------------------------------ cluster
source "$HERE/../common/cluster.bash"   # GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT

TP=${TP:-4}
PP=${PP:-1}
SEQ_LEN=${SEQ_LEN:-4096}   # a pair longer than this is dropped and counted, never one side truncated
MBS=${MBS:-1}
GBS=${GBS:-16}             # pairs' packs per step: the loss is normalised by the step's pairs
LR=${LR:-$DEFAULT_LR}
PROMPT_TYPE=${PROMPT_TYPE:-qwen}

source "$HERE/qwen25_7b_model_args.bash"   # MODEL_ARGS

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel
    --use-distributed-optimizer
)

TRAIN_ARGS=(
    "${PREF_ARGS[@]}"
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-epochs 1
    --lr "$LR"
    --min-lr 1e-7
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.0
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --seed 1234
)

# Raw pairs, tokenised and packed at the start (cached beside them; preprocess_data.py's flags).
DATA_ARGS=(
    --data-path "$DATA_PATH"
    --handler-name AlpacaStylePairwiseHandler
    --prompt-type "$PROMPT_TYPE"
    --neat-pack
    --tokenizer-name-or-path "$TOKENIZER_PATH"
)

CKPT_ARGS=(
    --finetune
    --load "$CKPT_LOAD_DIR"
    --save "$CKPT_SAVE_DIR"
    --save-interval 500
)
if [[ -n "$SAVE_HF_DIR" ]]; then
    CKPT_ARGS+=(--save-hf "$SAVE_HF_DIR")
fi

source "$HERE/../common/launch_posttrain.bash"   # OVERRIDES, PRINT_ARGS, DRY_RUN, then torchrun

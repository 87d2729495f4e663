#!/bin/bash
# KTO of the Qwen2.5-7B SFT model on unpaired desirable/undesirable samples, neat-packed in 4k packs:
# TP 4 x DP 2, bf16, one node of 8 GPUs. Two steps: the rows are tokenised and packed (preprocess_data.py,
# cached: a rerun with the same inputs and flags reuses the packs), then trained (posttrain.py --stage kto).
#
#   bash examples/qwen25/tune_qwen25_7b_4k_kto_pack.sh            # preprocess, then train on 8 GPUs
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_kto_pack.sh  # check both commands' flags, no GPU or data
#   PRINT_ARGS=1 bash examples/qwen25/tune_qwen25_7b_4k_kto_pack.sh
#
# Input rows: Alpaca {"instruction", "input", "output", "label": true|false} (TRL's boolean label); ShareGPT
# conversations ending with the answer: HANDLER=SharegptStyleKTOHandler; LLaMA-Factory's kto_tag column:
# LABEL_COLUMN=kto_tag. Each sample is packed with its KL partner (its prompt, the previous row's completion),
# so a 4k pack holds couples of up to 4096 tokens (longer ones are dropped and counted).
# Before: tune_qwen25_7b_4k_full_pack.sh (the SFT model: CKPT_LOAD_DIR), or a HF directory.
# The reference is a frozen copy of CKPT_LOAD_DIR (REF_LOAD=<dir>: another model; README "KTO").
# Multi-node (NNODES, NODE_RANK, MASTER_ADDR) and OVERRIDES=file.sh work as in tune_qwen25_7b_4k_full_pack.sh;
# with several nodes, preprocess once (NNODES=1 TRAIN=0 bash ...), then run PREPROCESS=0 bash ... on every node.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export CUDA_DEVICE_MAX_CONNECTIONS=1

# ------------------------------------------------------------------ paths (edit these)
INPUT=${INPUT:-./dataset/kto/kto.jsonl}                                  # KTO rows: a file or a directory
DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen2.5-7b/kto}                # the packs' prefix
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./ckpt/qwen2.5-7b-sft-pack}              # the SFT model: policy and reference
REF_LOAD=${REF_LOAD:-}                                                   # another reference model (default: none)
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-kto-pack}
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-tune_qwen25_7b_4k_kto_pack}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$LOG_DIR/tensorboard/$RUN_NAME}

# ------------------------------------------------------------------ cluster
source "$HERE/../common/cluster.bash"   # GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT

TP=${TP:-4}
PP=${PP:-1}
SEQ_LEN=${SEQ_LEN:-4096}   # the packs' length: a sample and its KL partner together fit it
MBS=${MBS:-1}
GBS=${GBS:-16}             # packs per step; the KL reference point is estimated over all their couples
PROMPT_TYPE=${PROMPT_TYPE:-qwen}
HANDLER=${HANDLER:-AlpacaStyleKTOHandler}
LABEL_COLUMN=${LABEL_COLUMN:-label}
PREPROCESS=${PREPROCESS:-1}   # 0: the packs exist already (skip the data step)
TRAIN=${TRAIN:-1}             # 0: the data step only

# ------------------------------------------------------------------ KTO (TRL's KTOConfig defaults)
STAGE_ARGS=(
    --stage kto
    --kto-beta 0.1
    --kto-desirable-weight 1.0      # raise the rarer kind's weight so that desirable x weight is 1 to 4/3 of
    --kto-undesirable-weight 1.0    # undesirable x weight (the KTO paper's advice; TRL warns outside it)
)

PREPROCESS_ARGS=(
    --input "$INPUT"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
    --output-prefix "$DATA_PATH"
    --handler-name "$HANDLER"
    --prompt-type "$PROMPT_TYPE"
    --map-keys "{\"label\": \"$LABEL_COLUMN\"}"
    --seq-length "$SEQ_LEN"
    --pack
    --neat-pack
    --workers 8
    --log-interval 1000
)

source "$HERE/qwen25_7b_model_args.bash"   # MODEL_ARGS

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel
    --use-distributed-optimizer
)

TRAIN_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters 1000
    --lr 5e-7
    --min-lr 5e-8
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1
    --weight-decay 0.0
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --seed 1234
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --split 100,0,0
    --is-instruction-dataset
    --neat-pack
    --reset-position-ids
    --prompt-type "$PROMPT_TYPE"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
)

CKPT_ARGS=(
    --finetune
    --load "$CKPT_LOAD_DIR"
    --save "$CKPT_SAVE_DIR"
    --save-interval 200
)
if [[ -n "$REF_LOAD" ]]; then
    CKPT_ARGS+=(--ref-load "$REF_LOAD")
fi

source "$HERE/../common/launch_posttrain.bash"   # OVERRIDES, PRINT_ARGS, DRY_RUN, then torchrun

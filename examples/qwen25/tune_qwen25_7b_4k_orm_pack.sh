#!/bin/bash
# Outcome reward model from Qwen2.5-7B on neat-packed 4k preference pairs: a scalar score head in place of the
# LM head, Bradley-Terry loss per pair; TP 4 x DP 2, bf16, 8 GPUs.
#
#   bash examples/qwen25/tune_qwen25_7b_4k_orm_pack.sh
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_orm_pack.sh   # parse + validate the flags, no GPU needed
#
# Before: data_convert_qwen25_pairwise_pack.sh (the pairs, same --seq-length and --prompt-type) and the SFT
#         model: tune_qwen25_7b_4k_full_pack.sh's checkpoint (TP 4), or CKPT_LOAD_DIR=<a HF directory>.
#         The score head starts from its seeded draw (the same at every layout).
# After:  SAVE_HF_DIR=<new dir> (or ckpt_convert_qwen25_mcore2hf.sh on CKPT_SAVE_DIR) writes a transformers
#         Qwen2ForSequenceClassification (num_labels 1, pad_token_id the token the reward is pooled past);
#         posttrain.py --stage score --load <it> writes each rollout's 'reward' for --stage grpo.
# Hooks as tune_qwen25_7b_4k_full_pack.sh's: OVERRIDES=file.sh, PRINT_ARGS=1, DRY_RUN=1, NNODES/NODE_RANK/...
set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1

# ------------------------------------------------------------------ paths (edit these)
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./ckpt/qwen2.5-7b-sft-pack}   # the SFT model (Megatron TP 4, or a HF directory)
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-orm-pack}
SAVE_HF_DIR=${SAVE_HF_DIR:-}   # if set: the reward model as a HF directory when training ends (--save-hf)
DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen2.5-7b/pairs}   # --output-prefix of the data script
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-tune_qwen25_7b_4k_orm_pack}

# ------------------------------------------------------------------ cluster
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

TP=${TP:-4}   # the SFT checkpoint's
PP=${PP:-1}
SEQ_LEN=${SEQ_LEN:-4096}   # the data script's --seq-length
MBS=${MBS:-1}
GBS=${GBS:-32}   # packs per step (several pairs each)
PROMPT_TYPE=${PROMPT_TYPE:-qwen}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

# Qwen2.5-7B architecture (config.json of the HF checkpoint).
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 3584
    --ffn-hidden-size 18944
    --num-attention-heads 28
    --group-query-attention
    --num-query-groups 4
    --add-qkv-bias
    --disable-bias-linear
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 1000000
    --untie-embeddings-and-output-weights
    --padded-vocab-size 152064
    --seq-length "$SEQ_LEN"
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel            # the score head scores its slice of the tokens; its gradient is summed over TP
    --use-distributed-optimizer
)

# One epoch over the pairs, as reward models are usually trained (more overfits the preferences).
TRAIN_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-epochs 1
    --lr 5e-6
    --min-lr 5e-7
    --lr-decay-style cosine
    --lr-warmup-fraction 0.03
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

# --stage orm: the score head replaces the output layer; the reward of a sample is the head at its last token
# (that is not the pad token), -log sigmoid(r_chosen - r_rejected) per pair, averaged over the step's pairs.
CKPT_ARGS=(
    --stage orm
    --finetune
    --load "$CKPT_LOAD_DIR"
    --save "$CKPT_SAVE_DIR"
    --save-interval 500
)
if [[ -n "$SAVE_HF_DIR" ]]; then
    CKPT_ARGS+=(--save-hf "$SAVE_HF_DIR")
fi

OUTPUT_ARGS=(
    --log-interval 1
    --eval-iters 0
    --tensorboard-dir "$LOG_DIR/tensorboard/$RUN_NAME"
    --metrics-file "$LOG_DIR/$RUN_NAME.metrics.jsonl"
)

if [[ -n "${OVERRIDES:-}" ]]; then
    # shellcheck source=/dev/null
    source "$OVERRIDES"
fi

TRAIN_CMD_ARGS=(
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}"
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '#@ posttrain.py world_size=%s\n' "$WORLD_SIZE"
    printf '%s\n' "${TRAIN_CMD_ARGS[@]}"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    WORLD_SIZE=$WORLD_SIZE "$PYTHON" "$REPO_DIR/posttrain.py" "${TRAIN_CMD_ARGS[@]}" --dry-run
    exit 0
fi

mkdir -p "$LOG_DIR"
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/posttrain.py" "${TRAIN_CMD_ARGS[@]}" \
    2>&1 | tee "$LOG_DIR/${RUN_NAME}_node${NODE_RANK}.log"

#!/bin/bash
# Full-parameter SFT of Qwen2.5-7B on neat-packed 4k instruction data: TP 4 x PP 1, bf16.
#
#   bash examples/qwen25/tune_qwen25_7b_4k_full_pack.sh            # one node, 8 GPUs (TP 4 x DP 2)
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> \
#       bash examples/qwen25/tune_qwen25_7b_4k_full_pack.sh        # run on every node (docs/multinode.md)
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_full_pack.sh  # parse + validate the flags, no GPU needed
#
# Before: data_convert_qwen25_instruction_pack.sh (packed data, same --seq-length and --prompt-type)
#         ckpt_convert_qwen25_hf2mcore.sh         (HF weights -> megatron, same TP/PP as here), or skip it:
#         CKPT_LOAD_DIR=<the HF model directory> loads it directly (each rank reads its own slice)
# After:  ckpt_convert_qwen25_mcore2hf.sh         (trained weights -> HF), or SAVE_HF_DIR=<new dir> here
#
# Every variable below can be overridden from the environment; tune_qwen25_7b_32k_full_pack_cp.sh runs this
# script with SEQ_LEN=32768 CP=2 (context parallelism) and its own names; examples/qwen3/ runs it for
# Qwen3-8B (MODEL_ARGS_FILE, PROMPT_TYPE). Further hooks:
#   MODEL_ARGS_FILE=f  sourced right after MODEL_ARGS below: another model's MODEL_ARGS array
#   OVERRIDES=file.sh  sourced after the argument arrays are built, so it may reassign any
#                      *_ARGS array (site settings; tests/test_multinode.py puts a tiny model here)
#   PRINT_ARGS=1       print the Python entry point and its arguments one per line, then exit
#                      (tests/test_example_flags.py parses them with the real parsers)
set -euo pipefail

# Megatron's tensor/sequence-parallel communication overlap relies on kernels being issued in order.
export CUDA_DEVICE_MAX_CONNECTIONS=1

# ------------------------------------------------------------------ paths (edit these)
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_weights/qwen2.5-7b-mcore-tp4pp1}  # written by ckpt_convert_qwen25_hf2mcore.sh
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-sft-pack}
SAVE_HF_DIR=${SAVE_HF_DIR:-}   # if set: the trained model as a HF directory when training ends (--save-hf)
DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen2.5-7b/alpaca}           # --output-prefix of the data script
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-tune_qwen25_7b_4k_full_pack}   # names the tensorboard dir, metrics file and node logs
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$LOG_DIR/tensorboard/$RUN_NAME}

# ------------------------------------------------------------------ cluster (one value per node for NODE_RANK)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}   # address of the node with NODE_RANK=0, reachable from all nodes
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

# Must equal --target-tensor/pipeline/expert-parallel-size of ckpt_convert_qwen25_hf2mcore.sh.
TP=${TP:-4}
PP=${PP:-1}
# Expert parallelism (MoE models: examples/qwen3_moe/): each EP rank holds num_experts / EP experts.
EP=${EP:-1}
# Context parallelism: every pack split over CP ranks (zigzag per sample). The data script's
# PAD_MULTIPLE should then be 2 x CP x TP (sequence parallel), else training pads the samples itself.
CP=${CP:-1}
SEQ_LEN=${SEQ_LEN:-4096}   # must equal --seq-length of the data script: one pack is one training sample
MBS=${MBS:-1}
GBS=${GBS:-8}          # a multiple of MBS x data-parallel size (WORLD_SIZE / (TP x PP x CP))
PROMPT_TYPE=${PROMPT_TYPE:-qwen}   # the data script's --prompt-type
# Packing at load time (data written with PACK=0, one sample per document): dp_balanced or default_dynamic_cp
# (tune_qwen25_7b_dynamic_cp.sh), rows of MAX_SEQLEN_PER_RANK tokens per rank. none: the data's own neat packs.
PACKING_SCHEDULER=${PACKING_SCHEDULER:-none}
MAX_SEQLEN_PER_RANK=${MAX_SEQLEN_PER_RANK:-$SEQ_LEN}

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
    --add-qkv-bias                 # Qwen2 has biases on q/k/v only ...
    --disable-bias-linear          # ... and on no other linear layer
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 1000000
    --untie-embeddings-and-output-weights
    --padded-vocab-size 152064     # the HF embedding's row count, so converted weights fit exactly
    --seq-length "$SEQ_LEN"
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
if [[ -n "${MODEL_ARGS_FILE:-}" ]]; then
    # shellcheck source=/dev/null
    source "$MODEL_ARGS_FILE"
fi

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
    --expert-model-parallel-size "$EP"
    --sequence-parallel            # shards layer-norm/dropout activations over TP: needed to fit 4k x 7B
    --use-distributed-optimizer    # shards Adam state over data-parallel ranks
)

TRAIN_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters 2000
    --lr 7.75e-7
    --min-lr 7.75e-8
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --weight-decay 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --seed 1234
)

# Packs from data_convert_qwen25_instruction_pack.sh. --neat-pack isolates the samples of a pack
# (attention, labels) and, with --reset-position-ids, restarts RoPE positions at every sample, so a
# packed sample trains exactly as it would alone. Packs are shuffled (no --no-shuffle): the packer
# emits packs ordered by sample length; add --no-shuffle only for loss-comparison runs.
DATA_ARGS=(
    --data-path "$DATA_PATH"
    --split 100,0,0
    --is-instruction-dataset
    --reset-position-ids
    --prompt-type "$PROMPT_TYPE"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
)
if [[ "$PACKING_SCHEDULER" == none ]]; then
    DATA_ARGS+=(--neat-pack)
else  # unpacked data, packed per step: every sample isolated in its row, positions restarting per sample
    DATA_ARGS+=(--sequence-packing-scheduler "$PACKING_SCHEDULER" --max-seqlen-per-dp-cp-rank "$MAX_SEQLEN_PER_RANK")
fi

# --finetune: take the converted weights only and start at iteration 0 with a fresh optimizer (implied when
# CKPT_LOAD_DIR is a HF directory; the model flags above must then agree with its config.json).
CKPT_ARGS=(
    --stage sft
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
    --tensorboard-dir "$TENSORBOARD_DIR"
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
    # One plain process that believes it is one of WORLD_SIZE ranks: the TP/PP/batch-size checks are real.
    WORLD_SIZE=$WORLD_SIZE "$PYTHON" "$REPO_DIR/posttrain.py" "${TRAIN_CMD_ARGS[@]}" --dry-run
    exit 0
fi

mkdir -p "$LOG_DIR"
# One log per node: on a shared filesystem the nodes would otherwise write the same file.
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/posttrain.py" "${TRAIN_CMD_ARGS[@]}" \
    2>&1 | tee "$LOG_DIR/${RUN_NAME}_node${NODE_RANK}.log"

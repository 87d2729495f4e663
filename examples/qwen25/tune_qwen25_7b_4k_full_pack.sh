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
#   MODEL_ARGS_FILE=f  sourced instead of qwen25_7b_model_args.bash: another model's MODEL_ARGS array
#   OVERRIDES=file.sh  sourced after the argument arrays are built, so it may reassign any
#                      *_ARGS array (site settings; tests/test_multinode.py puts a tiny model here)
#   PRINT_ARGS=1       print the Python entry point and its arguments one per line, then exit
#                      (tests/test_example_flags.py parses them with the real parsers)
# The cluster variables and DISTRIBUTED_ARGS come from ../common/cluster.bash, the hooks and the launch from
# ../common/launch_posttrain.bash (shared by every tune_*.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

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
source "$HERE/../common/cluster.bash"   # GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT

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
# Activation recomputation: the first RECOMPUTE_LAYERS layers of each pipeline stage recompute their activations
# in the backward (Megatron-LM's block method; 0: none). More layers, less memory, more compute (DRY_RUN=1 shows
# the memory estimate and the largest micro-batch it allows).
RECOMPUTE_LAYERS=${RECOMPUTE_LAYERS:-0}

source "${MODEL_ARGS_FILE:-$HERE/qwen25_7b_model_args.bash}"   # MODEL_ARGS: Qwen2.5-7B, or another model's

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
if (( RECOMPUTE_LAYERS > 0 )); then
    TRAIN_ARGS+=(--recompute-granularity full --recompute-method block --recompute-num-layers "$RECOMPUTE_LAYERS")
fi

# Packs from data_convert_qwen25_instruction_pack.sh. --neat-pack isolates the samples of a pack
# (attention, labels) and, with --reset-position-ids, restarts RoPE positions at every sample, so a
# packed sample trains exactly as it would alone. Packs are shuffled, in a new seeded order every epoch (no
# --no-shuffle; the files already hold them in a seeded, stratified order): add --no-shuffle only for
# loss-comparison runs.
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

source "$HERE/../common/launch_posttrain.bash"   # OVERRIDES, PRINT_ARGS, DRY_RUN, then torchrun

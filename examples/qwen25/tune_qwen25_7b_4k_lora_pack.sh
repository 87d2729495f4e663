#!/bin/bash
# LoRA SFT of Qwen2.5-7B on neat-packed 4k instruction data, straight from the Hugging Face directory:
# TP 1 (the frozen bf16 base is 15 GB; only the adapters train, so one 80 GB GPU holds a rank), bf16.
#
#   bash examples/qwen25/tune_qwen25_7b_4k_lora_pack.sh                    # one node, 8 GPUs (DP 8)
#   GPUS_PER_NODE=1 bash examples/qwen25/tune_qwen25_7b_4k_lora_pack.sh    # one GPU: GBS 8 = 8 micro-batches
#   LORA_LOAD=./ckpt/qwen2.5-7b-lora-pack bash ...                         # resume from the adapters' --save
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_lora_pack.sh          # parse + validate the flags, no GPU
#
# Before: data_convert_qwen25_instruction_pack.sh (packed data, same --seq-length and --prompt-type). No
#         weight conversion: each rank reads the HF model itself (CKPT_LOAD_DIR, the base; it stays frozen).
# After:  SAVE_HF_DIR holds a PEFT adapter directory (peft.PeftModel.from_pretrained(base, SAVE_HF_DIR), or
#         vLLM's LoRA loading); LORA_MERGE=1 writes the merged transformers model there instead. Later,
#         convert_ckpt.py --load-model-type hf --load-dir BASE --lora-load CKPT_SAVE_DIR --save-model-type hf
#         --save-dir DIR [--lora-merge] exports any saved iteration the same way.
#
# --save writes the adapters and their optimizer state only (MBs, not the 7B model), with the base's path and
# content fingerprint: a resume (LORA_LOAD) or an export on another base is refused. The multi-node variables
# (NNODES, NODE_RANK, MASTER_ADDR), OVERRIDES=file.sh and PRINT_ARGS=1 work as in tune_qwen25_7b_4k_full_pack.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export CUDA_DEVICE_MAX_CONNECTIONS=1

# ------------------------------------------------------------------ paths (edit these)
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_from_hf/qwen2.5-7b-instruct}   # the base: a HF directory (or a Megatron one)
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-lora-pack}          # the adapters (not the base's directory)
LORA_LOAD=${LORA_LOAD:-}          # a LoRA checkpoint (CKPT_SAVE_DIR of an earlier run) to resume from
SAVE_HF_DIR=${SAVE_HF_DIR:-./ckpt/qwen2.5-7b-lora-peft}   # at the end: a PEFT adapter directory (must be new)
LORA_MERGE=${LORA_MERGE:-0}       # 1: SAVE_HF_DIR gets the merged model instead
DATA_PATH=${DATA_PATH:-./finetune_dataset/qwen2.5-7b/alpaca}         # --output-prefix of the data script
TOKENIZER_PATH=${TOKENIZER_PATH:-$CKPT_LOAD_DIR}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-tune_qwen25_7b_4k_lora_pack}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$LOG_DIR/tensorboard/$RUN_NAME}

# ------------------------------------------------------------------ cluster
source "$HERE/../common/cluster.bash"   # GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT

TP=${TP:-1}       # any TP/PP/CP works (the adapters shard like their linears); TP 1 needs no communication
PP=${PP:-1}
SEQ_LEN=${SEQ_LEN:-4096}   # must equal --seq-length of the data script
MBS=${MBS:-1}
GBS=${GBS:-8}
PROMPT_TYPE=${PROMPT_TYPE:-qwen}

# ------------------------------------------------------------------ LoRA
LORA_R=${LORA_R:-16}
LORA_ALPHA=${LORA_ALPHA:-32}       # scale alpha / r = 2
STAGE_ARGS=(
    --lora-r "$LORA_R"
    --lora-alpha "$LORA_ALPHA"
    --lora-dropout 0.0
    --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2   # = q k v o gate up down_proj (all-linear)
)
if [[ -n "$LORA_LOAD" ]]; then
    STAGE_ARGS+=(--lora-load "$LORA_LOAD")
fi

source "$HERE/qwen25_7b_model_args.bash"   # MODEL_ARGS

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)

# LoRA's usual recipe: a far larger lr than full fine-tuning (only the low-rank updates move), no weight decay.
TRAIN_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters 2000
    --lr 1e-4
    --min-lr 1e-5
    --lr-decay-style cosine
    --lr-warmup-fraction 0.03
    --weight-decay 0.0
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.999
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
    --stage sft
    --load "$CKPT_LOAD_DIR"
    --save "$CKPT_SAVE_DIR"
    --save-interval 500
    --save-hf "$SAVE_HF_DIR"
)
if [[ "$LORA_MERGE" == 1 ]]; then
    CKPT_ARGS+=(--lora-merge)
fi

source "$HERE/../common/launch_posttrain.bash"   # OVERRIDES, PRINT_ARGS, DRY_RUN, then torchrun

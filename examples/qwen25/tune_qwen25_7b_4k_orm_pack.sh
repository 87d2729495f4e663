#!/bin/bash
# Reward models from Qwen2.5-7B on neat-packed 4k data, TP 4 x DP 2, bf16, 8 GPUs:
#   STAGE=orm (default): an outcome reward model on preference pairs: a scalar score head in place of the LM head,
#                        Bradley-Terry loss per pair.
#   STAGE=prm (tune_qwen25_7b_4k_prm_pack.sh sets it): a process reward model on Math-Shepherd rows: at each step
#                        tag, a 2-way softmax over the logits of + and - (the LM head kept), cross entropy with the
#                        step's label.
#
#   bash examples/qwen25/tune_qwen25_7b_4k_orm_pack.sh
#   DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_orm_pack.sh   # parse + validate the flags, no GPU needed
#
# Before: data_convert_qwen25_pairwise_pack.sh (orm: the pairs, same --seq-length and --prompt-type) or
#         data_convert_qwen25_process_reward_pack.sh (prm: its sidecar names the tag and reward tokens), and the SFT
#         model: tune_qwen25_7b_4k_full_pack.sh's checkpoint (TP 4), or CKPT_LOAD_DIR=<a HF directory>.
#         The orm score head starts from its seeded draw (the same at every layout).
# After:  SAVE_HF_DIR=<new dir> (or ckpt_convert_qwen25_mcore2hf.sh on CKPT_SAVE_DIR) writes, for orm, a
#         transformers Qwen2ForSequenceClassification (num_labels 1, pad_token_id the token the reward is pooled
#         past): posttrain.py --stage score --load <it> writes each rollout's 'reward' for --stage grpo; for prm, a
#         Qwen2ForCausalLM: a step's score is softmax(logits[tag, [+, -]])[0] at its tag.
# Hooks as tune_qwen25_7b_4k_full_pack.sh's: OVERRIDES=file.sh, PRINT_ARGS=1, DRY_RUN=1, NNODES/NODE_RANK/...
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export CUDA_DEVICE_MAX_CONNECTIONS=1

STAGE=${STAGE:-orm}   # orm or prm
case "$STAGE" in
    # orm: the reward of a sample is the score head at its last token (that is not the pad token),
    # -log sigmoid(r_chosen - r_rejected) per pair, averaged over the step's pairs.
    orm) DEFAULT_DATA=./finetune_dataset/qwen2.5-7b/pairs; LR=5e-6; MIN_LR=5e-7
         PROMPT_ARGS=(--prompt-type "${PROMPT_TYPE:-qwen}") ;;
    # prm: the loss is read at the step tags only, averaged over the step's tags; 'accuracy' is logged. The text
    # is tokenised as written (no template), so no --prompt-type.
    prm) DEFAULT_DATA=./finetune_dataset/qwen2.5-7b/math_shepherd; LR=2e-6; MIN_LR=2e-7; PROMPT_ARGS=() ;;
    *) echo "STAGE=$STAGE: this script trains orm or prm" >&2; exit 1 ;;
esac

# ------------------------------------------------------------------ paths (edit these)
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./ckpt/qwen2.5-7b-sft-pack}   # the SFT model (Megatron TP 4, or a HF directory)
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen2.5-7b-$STAGE-pack}
SAVE_HF_DIR=${SAVE_HF_DIR:-}   # if set: the reward model as a HF directory when training ends (--save-hf)
DATA_PATH=${DATA_PATH:-$DEFAULT_DATA}   # --output-prefix of the data script
TOKENIZER_PATH=${TOKENIZER_PATH:-./model_from_hf/qwen2.5-7b-instruct}
LOG_DIR=${LOG_DIR:-./logs}
RUN_NAME=${RUN_NAME:-tune_qwen25_7b_4k_${STAGE}_pack}

# ------------------------------------------------------------------ cluster
source "$HERE/../common/cluster.bash"   # GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT

TP=${TP:-4}   # the SFT checkpoint's
PP=${PP:-1}
SEQ_LEN=${SEQ_LEN:-4096}   # the data script's --seq-length
MBS=${MBS:-1}
GBS=${GBS:-32}   # packs per step (several pairs or solutions each)

source "$HERE/qwen25_7b_model_args.bash"   # MODEL_ARGS

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel            # the score head scores its slice of the tokens; its gradient is summed over TP
    --use-distributed-optimizer
)

# One epoch over the data, as reward models are usually trained (more overfits the preferences).
TRAIN_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-epochs 1
    --lr "$LR"
    --min-lr "$MIN_LR"
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
    "${PROMPT_ARGS[@]}"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$TOKENIZER_PATH"
)

CKPT_ARGS=(
    --stage "$STAGE"
    --finetune
    --load "$CKPT_LOAD_DIR"
    --save "$CKPT_SAVE_DIR"
    --save-interval 500
)
if [[ -n "$SAVE_HF_DIR" ]]; then
    CKPT_ARGS+=(--save-hf "$SAVE_HF_DIR")
fi

source "$HERE/../common/launch_posttrain.bash"   # OVERRIDES, PRINT_ARGS, DRY_RUN, then torchrun

#!/bin/bash
# Replay a generation engine's rollout files round after round under one torchrun job
# (examples/rl/replay_rollouts.py: score old_logprobs, GRPO step, save, HF export per round).
#
#   ROLLOUT_DIR=rollouts/ CKPT_LOAD_DIR=<HF dir or Megatron checkpoint> bash examples/rl/replay_rollouts.sh
#   DRY_RUN=1 bash examples/rl/replay_rollouts.sh     # parse + validate the flags, no GPU, data or weights
#   PRINT_ARGS=1 bash examples/rl/replay_rollouts.sh  # print the entry point and its arguments, one per line
#
# ROLLOUT_DIR holds one .jsonl/.parquet file per round, replayed in name order (round_000.jsonl, ...);
# the format is docs/rl.md's. The model is Qwen3-8B (MODEL_ARGS_FILE: another model's MODEL_ARGS array).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-./model_from_hf/qwen3-8b}   # HF directory (read directly) or Megatron checkpoint
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen3-8b-grpo}
ROLLOUT_DIR=${ROLLOUT_DIR:-./rollouts}
OUT_DIR=${OUT_DIR:-./runs/rl_replay}                        # hf/iter_N: the weights the engine reloads
MODEL_ARGS_FILE=${MODEL_ARGS_FILE:-$HERE/../qwen3/qwen3_8b_model_args.bash}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-4}
PP=${PP:-1}
SEQ_LEN=${SEQ_LEN:-8192}
MAX_TOKENS_PER_ROW=${MAX_TOKENS_PER_ROW:-$SEQ_LEN}   # --max-seqlen-per-dp-cp-rank: the hard cap of a packed row
GBS=${GBS:-256}                                      # rollouts per optimizer step
ROUNDS_ITERS=${ROUNDS_ITERS:-100}                    # --train-iters: the steps the whole replay may take (schedule)
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

# shellcheck source=/dev/null
source "$MODEL_ARGS_FILE"   # MODEL_ARGS (uses SEQ_LEN)

ROLLOUT_FILES=()
if [[ -d "$ROLLOUT_DIR" ]]; then
    while IFS= read -r f; do ROLLOUT_FILES+=("$f"); done < <(find "$ROLLOUT_DIR" -maxdepth 1 -type f \
        \( -name '*.jsonl' -o -name '*.parquet' -o -name '*.json' \) | sort)
fi
if [[ ${#ROLLOUT_FILES[@]} -eq 0 ]]; then
    [[ "${DRY_RUN:-0}${PRINT_ARGS:-0}" != 00 ]] || { echo "replay_rollouts.sh: no rollout files in $ROLLOUT_DIR" >&2; exit 2; }
    ROLLOUT_FILES=("$ROLLOUT_DIR/round_000.jsonl")   # a dry run checks the flags only
fi

ARGS=(
    "${MODEL_ARGS[@]}"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
    --use-distributed-optimizer --bf16
    --load "$CKPT_LOAD_DIR" --finetune --save "$CKPT_SAVE_DIR" --no-save-optim
    --micro-batch-size 1 --global-batch-size "$GBS" --max-seqlen-per-dp-cp-rank "$MAX_TOKENS_PER_ROW"
    --train-iters "$ROUNDS_ITERS" --lr 1e-6 --lr-decay-style constant --lr-warmup-iters 0 --weight-decay 0.0
    --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999
    --clip-ratio 0.2 0.28 --loss-agg token-mean --advantage-estimator grpo
    --log-interval 1 --eval-iters 0 --metrics-file "$OUT_DIR/metrics.jsonl"
    --rollout-rounds "${ROLLOUT_FILES[@]}" --rl-output-dir "$OUT_DIR"
)

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then   # tests/test_example_flags.py
    printf '#@ examples/rl/replay_rollouts.py world_size=%s\n' "$WORLD_SIZE"; printf '%s\n' "${ARGS[@]}"
    exit 0
fi
source "$HERE/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    # One plain process that believes it is one of WORLD_SIZE ranks: the TP/PP/batch-size checks are real.
    WORLD_SIZE=$WORLD_SIZE "$PYTHON" "$REPO_DIR/examples/rl/replay_rollouts.py" "${ARGS[@]}" --dry-run
    exit 0
fi
mkdir -p "$OUT_DIR"
"$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$REPO_DIR/examples/rl/replay_rollouts.py" "${ARGS[@]}"

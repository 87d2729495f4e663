#!/bin/bash
# A GRPO loop on a generated task whose reward rises, rollouts sampled from the model itself, on a CPU
# (examples/rl/reward_loop.py): a tiny Qwen2-style model learns to repeat the prompt's last token.
#
#   bash examples/rl/run_reward_loop.sh              # one process (~1 min on 2 idle cores)
#   NPROC=2 bash examples/rl/run_reward_loop.sh      # torchrun, 2 data-parallel ranks
#   DRY_RUN=1 bash examples/rl/run_reward_loop.sh    # parse + validate the flags only
#   PRINT_ARGS=1 bash examples/rl/run_reward_loop.sh # print the entry point and its arguments, one per line
#
# Environment: OUT (runs/rl_reward_loop), NPROC (1), ROUNDS (8), PYTHON (see scripts/python_env.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
cd "$REPO_DIR"
OUT=${OUT:-runs/rl_reward_loop}
NPROC=${NPROC:-1}
ROUNDS=${ROUNDS:-8}
STEPS_PER_ROUND=2

MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --add-qkv-bias --disable-bias-linear --swiglu
    --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope --rotary-base 1000000
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --padded-vocab-size 8            # BOS = 1, the task's words are 2..7
    --seq-length 512
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --max-seqlen-per-dp-cp-rank 512
    --train-iters $((ROUNDS * STEPS_PER_ROUND)) --lr 5e-3 --min-lr 0 --lr-decay-style constant
    --lr-warmup-iters 0 --weight-decay 0.0 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 --seed 1
    --clip-ratio 0.2 --loss-agg token-mean --advantage-estimator grpo
    --log-interval 100 --eval-iters 0 --metrics-file "$OUT/metrics.jsonl"
)
LOOP_ARGS=(
    --rl-output-dir "$OUT" --rounds "$ROUNDS" --steps-per-round "$STEPS_PER_ROUND"
    --prompts-per-round 16 --samples-per-prompt 8 --prompt-length 2 --response-length 2 --temperature 1.0
)
ARGS=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${LOOP_ARGS[@]}")

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then   # tests/test_example_flags.py
    printf '#@ examples/rl/reward_loop.py world_size=%s\n' "$NPROC"; printf '%s\n' "${ARGS[@]}"
    exit 0
fi
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    WORLD_SIZE=$NPROC "$PYTHON" examples/rl/reward_loop.py "${ARGS[@]}" --dry-run
    exit 0
fi
rm -rf "$OUT"
mkdir -p "$OUT"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    examples/rl/reward_loop.py "${ARGS[@]}" 2> >(grep -v -E "UserWarning|warnings.warn|DeprecationWarning" >&2)
echo "per round: $OUT/rounds.jsonl   HF exports: $OUT/hf/"

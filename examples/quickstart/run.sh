#!/usr/bin/env bash
# Quickstart: packed fine-tuning end to end on a laptop CPU, in a few minutes.
#
#   make quickstart                      # sets up .venv, then runs this script
#   bash examples/quickstart/run.sh      # with an environment already set up
#
# 1. generates a deterministic instruction dataset (ShareGPT style, variable lengths) and a
#    tiny tokenizer with Qwen's chat tokens          -> $OUT/assets
# 2. preprocess_data.py --pack --neat-pack (qwen template) -> $OUT/data/sft_packed_*
# 3. posttrain.py under torchrun (gloo on CPU): a tiny Qwen2-style model, 300 steps,
#    validation every 100, checkpoint at the end      -> $OUT/ckpt, $OUT/metrics.jsonl
# 4. a summary (pack fill, padding saved, loss start -> end, tokens/s) and $OUT/loss.png
#
# Environment: OUT (runs/quickstart), NPROC (1), TRAIN_ITERS (300), PYTHON (see scripts/python_env.sh).
# PRINT_ARGS=1 prints the commands' arguments without running anything (tests/test_example_flags.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
cd "$REPO_DIR"
OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-1}
TRAIN_ITERS=${TRAIN_ITERS:-300}
SEQ_LEN=512

PREPROCESS_ARGS=(
    --input "$OUT/assets/sharegpt.jsonl"
    --output-prefix "$OUT/data/sft"
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$OUT/assets/tokenizer"
    --handler-name SharegptStyleInstructionHandler
    --prompt-type qwen
    --seq-length "$SEQ_LEN"
    --pack
    --neat-pack
    --workers 2
)

# A tiny Qwen2-style model: GQA, qkv bias, SwiGLU, RMSNorm, RoPE, untied embeddings.
MODEL_ARGS=(
    --num-layers 2
    --hidden-size 128
    --ffn-hidden-size 384
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --add-qkv-bias
    --disable-bias-linear
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --rotary-base 1000000
    --untie-embeddings-and-output-weights
    --seq-length "$SEQ_LEN"
)

TRAIN_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --train-iters "$TRAIN_ITERS"
    --lr 3e-3
    --min-lr 3e-4
    --lr-decay-style cosine
    --lr-warmup-iters 20
    --weight-decay 0.01
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --seed 1234
)

DATA_ARGS=(
    --data-path "$OUT/data/sft"
    --split 98,2,0
    --is-instruction-dataset
    --neat-pack
    --reset-position-ids
    --prompt-type qwen
    --tokenizer-type PretrainedFromHF
    --tokenizer-name-or-path "$OUT/assets/tokenizer"
)

OUTPUT_ARGS=(
    --stage sft
    --save "$OUT/ckpt"
    --log-interval 25
    --eval-interval 100
    --eval-iters 2
    --tensorboard-dir "$OUT/tensorboard"
    --metrics-file "$OUT/metrics.jsonl"
)

TRAIN_CMD_ARGS=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}")

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '#@ preprocess_data.py\n'; printf '%s\n' "${PREPROCESS_ARGS[@]}"
    printf '#@ posttrain.py world_size=%s\n' "$NPROC"; printf '%s\n' "${TRAIN_CMD_ARGS[@]}"
    exit 0
fi

rm -rf "$OUT/ckpt" "$OUT/metrics.jsonl" "$OUT/tensorboard"
mkdir -p "$OUT"
start=$(date +%s)
echo "== 1/4 generating the demo dataset and tokenizer"
"$PYTHON" -m mindspeed_pack.data.toy --out "$OUT/assets" --samples 4000
echo "== 2/4 preprocessing: pack + neat-pack"
"$PYTHON" preprocess_data.py "${PREPROCESS_ARGS[@]}"
echo "== 3/4 training (torchrun, $NPROC process(es), gloo on CPU)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((2 / NPROC > 0 ? 2 / NPROC : 1))} \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" posttrain.py "${TRAIN_CMD_ARGS[@]}" \
    2> >(grep -v -E "UserWarning|warnings.warn" >&2)
echo "== 4/4 summary"
"$PYTHON" -m mindspeed_pack.tools.run_summary "$OUT/metrics.jsonl" --data-prefix "$OUT/data/sft" \
    --plot "$OUT/loss.png" --json "$OUT/summary.json"
echo "checkpoint: $OUT/ckpt   loss curve: $OUT/loss.png   total $(( $(date +%s) - start ))s"
# the loss must have fallen clearly, or the quickstart failed
"$PYTHON" - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
if not s["loss end"] < 0.7 * s["loss start"]:
    sys.exit(f"quickstart: the loss did not fall clearly ({s['loss start']:.3f} -> {s['loss end']:.3f})")
PY

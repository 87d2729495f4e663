#!/usr/bin/env bash
# Quickstart: packed fine-tuning end to end on a laptop CPU, in a few minutes.
#
#   make quickstart                      # sets up .venv, then runs this script
#   bash examples/quickstart/run.sh      # with an environment already set up
#
# 1. generates a deterministic instruction dataset (ShareGPT style, variable lengths) and a
#    tiny tokenizer with Qwen's chat tokens          -> $OUT/assets
# 2. one command, posttrain.py --config configs/quickstart.yaml under torchrun (gloo on CPU): the raw
#    file tokenised and neat-packed (qwen template; cached in $OUT/data, reused by a second run), then a
#    tiny Qwen2-style model trained 300 steps, validation every 100, checkpoint at the end
#                                                     -> $OUT/ckpt, $OUT/metrics.jsonl (+ metrics.config.yaml)
# 3. a summary (pack fill, padding saved, loss start -> end, tokens/s) and $OUT/loss.png
#
# Environment: OUT (runs/quickstart), NPROC (1), TRAIN_ITERS (300), PYTHON (see scripts/python_env.sh).
# PRINT_ARGS=1 prints the commands' arguments without running anything (tests/test_example_flags.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
cd "$REPO_DIR"
OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-1}
TRAIN_ITERS=${TRAIN_ITERS:-300}

# One command: posttrain.py tokenises and neat-packs the raw ShareGPT file first (cached in $OUT/data),
# then trains; the model, data and training keys are in configs/quickstart.yaml, the paths here.
TRAIN_CMD_ARGS=(
    --config "$REPO_DIR/configs/quickstart.yaml"
    --data-path "$OUT/assets/sharegpt.jsonl"
    --tokenizer-name-or-path "$OUT/assets/tokenizer"
    --data-cache-path "$OUT/data"
    --train-iters "$TRAIN_ITERS"
    --save "$OUT/ckpt"
    --tensorboard-dir "$OUT/tensorboard"
    --metrics-file "$OUT/metrics.jsonl"
)

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '#@ posttrain.py world_size=%s\n' "$NPROC"; printf '%s\n' "${TRAIN_CMD_ARGS[@]}"
    exit 0
fi

rm -rf "$OUT/ckpt" "$OUT/metrics.jsonl" "$OUT/tensorboard"
mkdir -p "$OUT"
start=$(date +%s)
echo "== 1/3 generating the demo dataset and tokenizer"
"$PYTHON" -m mindspeed_pack.data.toy --out "$OUT/assets" --samples 4000
echo "== 2/3 one command: tokenise + neat-pack (once, cached), then train (torchrun, $NPROC process(es), gloo on CPU)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((2 / NPROC > 0 ? 2 / NPROC : 1))} \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" posttrain.py "${TRAIN_CMD_ARGS[@]}" \
    2> >(grep -v -E "UserWarning|warnings.warn" >&2)
echo "== 3/3 summary"
PACKS=$(ls -t "$OUT"/data/*_packed_meta.json | head -n 1)   # the packs this run trained on
"$PYTHON" -m mindspeed_pack.tools.run_summary "$OUT/metrics.jsonl" --data-prefix "${PACKS%_packed_meta.json}" \
    --plot "$OUT/loss.png" --json "$OUT/summary.json"
echo "checkpoint: $OUT/ckpt   loss curve: $OUT/loss.png   total $(( $(date +%s) - start ))s"
# the loss must have fallen clearly, or the quickstart failed
"$PYTHON" - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
if not s["loss end"] < 0.7 * s["loss start"]:
    sys.exit(f"quickstart: the loss did not fall clearly ({s['loss start']:.3f} -> {s['loss end']:.3f})")
PY

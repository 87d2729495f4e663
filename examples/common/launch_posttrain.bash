# The end every example training script shares, sourced once its argument arrays are built:
#   MODEL_ARGS PARALLEL_ARGS TRAIN_ARGS DATA_ARGS CKPT_ARGS   (every script)
#   OUTPUT_ARGS       optional: by default a log line per step, no evaluation, TensorBoard in TENSORBOARD_DIR
#                     (LOG_DIR/tensorboard/RUN_NAME) and the per-step metrics in LOG_DIR/RUN_NAME.metrics.jsonl
#   STAGE_ARGS        optional: the stage's own flags (KTO, LoRA, SimPO/ORPO ...)
#   PREPROCESS_ARGS   optional: preprocess_data.py's flags, run first (PREPROCESS=0 skips it, TRAIN=0 stops after it)
# Hooks: OVERRIDES=file.sh is sourced first, so it may reassign any *_ARGS array (site settings;
# tests/test_multinode.py puts a tiny model there); PRINT_ARGS=1 prints each entry point and its arguments one
# per line and exits (tests/test_example_flags.py parses them with the real parsers); DRY_RUN=1 validates them
# in one plain process that believes it is one of WORLD_SIZE ranks (the TP/PP/batch-size checks are real).
# Needs WORLD_SIZE, DISTRIBUTED_ARGS (common/cluster.bash), LOG_DIR, RUN_NAME and NODE_RANK.
if [[ ! -v OUTPUT_ARGS ]]; then
    OUTPUT_ARGS=(
        --log-interval 1
        --eval-iters 0
        --tensorboard-dir "${TENSORBOARD_DIR:-$LOG_DIR/tensorboard/$RUN_NAME}"
        --metrics-file "$LOG_DIR/$RUN_NAME.metrics.jsonl"
    )
fi
if [[ -n "${OVERRIDES:-}" ]]; then
    # shellcheck source=/dev/null
    source "$OVERRIDES"
fi
[[ -v STAGE_ARGS ]] || STAGE_ARGS=()
[[ -v PREPROCESS_ARGS ]] || PREPROCESS_ARGS=()

TRAIN_CMD_ARGS=(
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${STAGE_ARGS[@]}"
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    if (( ${#PREPROCESS_ARGS[@]} )); then
        printf '#@ preprocess_data.py\n'
        printf '%s\n' "${PREPROCESS_ARGS[@]}"
    fi
    printf '#@ posttrain.py world_size=%s\n' "$WORLD_SIZE"
    printf '%s\n' "${TRAIN_CMD_ARGS[@]}"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    if (( ${#PREPROCESS_ARGS[@]} )); then
        # preprocess_data.py's own parser and checks, without reading data or loading the tokenizer
        "$PYTHON" "$REPO_DIR/preprocess_data.py" "${PREPROCESS_ARGS[@]}" --dry-run
    fi
    WORLD_SIZE=$WORLD_SIZE "$PYTHON" "$REPO_DIR/posttrain.py" "${TRAIN_CMD_ARGS[@]}" --dry-run
    exit 0
fi

mkdir -p "$LOG_DIR"
if (( ${#PREPROCESS_ARGS[@]} )) && [[ "${PREPROCESS:-1}" == 1 ]]; then
    mkdir -p "$(dirname "$DATA_PATH")"
    "$PYTHON" "$REPO_DIR/preprocess_data.py" "${PREPROCESS_ARGS[@]}" 2>&1 | tee "$LOG_DIR/${RUN_NAME}_data.log"
fi
if [[ "${TRAIN:-1}" == 1 ]]; then
    # One log per node: on a shared filesystem the nodes would otherwise write the same file.
    "$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "$REPO_DIR/posttrain.py" "${TRAIN_CMD_ARGS[@]}" \
        2>&1 | tee "$LOG_DIR/${RUN_NAME}_node${NODE_RANK}.log"
fi

# The end every example data script shares, sourced once PREPROCESS_ARGS (preprocess_data.py's flags) is built:
# PRINT_ARGS=1 prints the entry point and its arguments one per line and exits (tests/test_example_flags.py parses
# them with the real parser); DRY_RUN=1 runs preprocess_data.py's own parser and checks (--dry-run: no data read,
# no tokenizer loaded); else preprocess, the log in LOG_DIR/RUN_NAME.log. Needs OUTPUT_PREFIX, LOG_DIR, RUN_NAME.
if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '#@ preprocess_data.py\n'
    printf '%s\n' "${PREPROCESS_ARGS[@]}"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    "$PYTHON" "$REPO_DIR/preprocess_data.py" "${PREPROCESS_ARGS[@]}" --dry-run
    exit 0
fi

mkdir -p "$(dirname "$OUTPUT_PREFIX")" "$LOG_DIR"
"$PYTHON" "$REPO_DIR/preprocess_data.py" "${PREPROCESS_ARGS[@]}" 2>&1 | tee "$LOG_DIR/$RUN_NAME.log"

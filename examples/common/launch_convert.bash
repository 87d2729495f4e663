# The end every example checkpoint-conversion script shares, sourced once CONVERT_ARGS (convert_ckpt.py's flags) is
# built: PRINT_ARGS=1 prints the entry point and its arguments one per line and exits (tests/test_example_flags.py
# parses them with the real parser); DRY_RUN=1 runs convert_ckpt.py's own parser without touching any weights; else
# convert, the log in LOG_DIR/RUN_NAME.log. Needs LOG_DIR, RUN_NAME.
if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '#@ convert_ckpt.py\n'
    printf '%s\n' "${CONVERT_ARGS[@]}"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/python_env.sh"   # sets REPO_DIR and PYTHON
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c '
import sys
from mindspeed_pack.convert.convert import build_parser
build_parser().parse_args(sys.argv[1:])
print("convert_ckpt.py arguments OK")' "${CONVERT_ARGS[@]}"
    exit 0
fi

mkdir -p "$LOG_DIR"
"$PYTHON" "$REPO_DIR/convert_ckpt.py" "${CONVERT_ARGS[@]}" 2>&1 | tee "$LOG_DIR/$RUN_NAME.log"

#!/usr/bin/env bash
# Create .venv with the CPU build of torch and mindspeed-pack (editable, C++ helpers built).
# Idempotent: a second run only re-checks. Usage: bash scripts/setup_env.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and alone, so nothing can pull a CUDA build in as a dependency
$PIP install -q torch==2.13.0
$PIP install -q -c constraints.txt setuptools wheel pybind11
$PIP install -q -c constraints.txt --no-build-isolation -e ".[dev]"
"$VENV/bin/python" -c "import mindspeed_pack._helpers, megatron.core, torch; print('environment ready: torch', torch.__version__)"

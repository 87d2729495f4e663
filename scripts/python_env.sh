# Sourced by the example scripts (examples/): choose the Python that has the project's packages (torch,
# megatron-core), so the scripts work in a fresh shell after `make quickstart` / `make test`.
#   1. $PYTHON when set;
#   2. `python` of an activated virtualenv or conda environment (e.g. the GPU install of README.md);
#   3. the repository's .venv/bin/python when present (what `make` sets up);
#   4. `python` on PATH.
# Sets REPO_DIR (the repository root) and PYTHON.
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]]; then
        PYTHON=python
    elif [[ -x "$REPO_DIR/.venv/bin/python" ]]; then
        PYTHON=$REPO_DIR/.venv/bin/python
    else
        PYTHON=python
    fi
fi

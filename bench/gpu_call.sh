#!/usr/bin/env bash
# One call on a bare GPU machine (no network, minutes of device time): install the carried wheels, build the
# C++ helper, check exactness on CUDA (tests/test_cuda.py), then the benchmark suite. Everything lands in $OUT
# (default ./gpu_out): build.log, test_cuda.log, suite.log (the whole output), suite.json.
#
#   # here, once: the megatron-core wheel for the machine's Python, in .whl/ (git-ignored, carried)
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
#   # there (carry .whl): extra arguments go to bench_gpu_train.py
#   bash bench/gpu_call.sh --global-batch 8 --steps 3
#
# SUITE_DEADLINE (seconds, default 420): no benchmark run starts after it, so the call ends inside its limit.
# FULL_TESTS=1: after the suite, the whole test suite with CUDA visible (16 workers, verbose, TESTS_TIMEOUT seconds,
# default 240; tests.log), its workers killed when it ends: a time-boxed run's orphans loaded the host during an
# earlier call's benchmark. SUITE=0 skips the suite (a call for the tests alone); CUDA_TESTS=0 skips
# tests/test_cuda.py (a second call on the same code, for more of the suite).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
start=$SECONDS
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| megatron-core', megatron.core.__version__)" 2>/dev/null
echo "set up in $((SECONDS - start)) s"

if [ "${CUDA_TESTS:-1}" = 1 ] && { [ "${SUITE:-1}" = 1 ] || [ "${FULL_TESTS:-0}" != 1 ]; }; then
    # its GPU checks side by side (each in its own process: two of them compile layers), then no workers left
    # (a tests-only call runs them with the rest)
    timeout -k 5 240 python3 -m pytest -q -rfE -n 4 tests/test_cuda.py -p no:cacheprovider >"$OUT/test_cuda.log" 2>&1
    echo "tests/test_cuda.py: rc $? ($((SECONDS - start)) s): $(tail -1 "$OUT/test_cuda.log")"
    pkill -9 -f "pytest|xdist|execnet" 2>/dev/null || true
fi
echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"

# the trainer's per-iteration lines and the loaders' chatter stay in the log; the tables come to the console
if [ "${SUITE:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 python3 bench/bench_gpu_train.py --suite --profile \
        --deadline "${SUITE_DEADLINE:-420}" --json "$OUT/suite.json" "$@" 2>&1 | tee "$OUT/suite.log" |
        grep -vE '^ \[|^ precision|^--load|^USDT|Loading weights|warnings.warn|Warning|^  |^$'
    echo "suite: rc ${PIPESTATUS[0]} ($((SECONDS - start)) s)"  # (the benchmark's status, not grep's)
fi

if [ "${FULL_TESTS:-0}" = 1 ]; then  # last: -v names each result as it lands, so a time-boxed run still says which
    timeout -k 5 "${TESTS_TIMEOUT:-240}" python3 -m pytest -v -rfE -n 16 --dist loadfile --timeout 150 tests \
        -p no:cacheprovider >"$OUT/tests.log" 2>&1
    echo "tests: rc $? ($((SECONDS - start)) s): $(tail -1 "$OUT/tests.log")"
    pkill -9 -f "pytest|xdist|execnet" 2>/dev/null  # a time-boxed run's workers must not outlive it
    grep -E "(FAILED|ERROR) tests/" "$OUT/tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -40
fi

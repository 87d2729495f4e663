# The two commands of the README: `make quickstart` (the main job on an embedded default)
# and `make test` (the test suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test quickstart bench clean

setup:
	bash scripts/setup_env.sh $(VENV)

# two workers (pytest-xdist), a file per worker at a time; conftest.py starts the multi-process files first
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

quickstart: setup
	bash examples/quickstart/run.sh

bench: setup
	$(PY) bench/bench_packing.py --quick

clean:
	rm -rf build *.egg-info runs

# Two commands do everything on a fresh machine (Python 3.11; no GPU needed):
#   make demo   set up .venv, then train on a local cluster (coordinator + 4 workers)
#   make test   set up .venv, then check stubs, lint, types, floors and run the tests
# While developing: make test-fast (the same checks, the tests not marked slow).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo check test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: on CPU machines 2.13.0 resolves to the CPU wheel (see README).
	$(BIN)/pip install --quiet torch==2.13.0
	# setuptools' note on editable installs ("folders ... with the same name as your package
	# may take precedence") does not apply: package-dir maps every package explicitly, and
	# its finder serves ripples.* from the checkout's root too (the tests run from there).
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet -e '.[dev,peers]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/ripples run --workers 4 --protocol ripples-smart --task digits --epochs 5 --output runs/demo

check: setup
	$(BIN)/python proto/generate.py --check
	$(BIN)/ruff check .
	$(BIN)/python tools/typecheck.py
	$(BIN)/python tools/layers.py --quiet
	$(BIN)/python tools/house_rules.py --quiet

# The suite runs in TEST_PROCESSES parallel pytest processes (pytest-xdist): its tests
# mostly start processes and wait on them, so one more than a 2-core machine's cores
# keeps both busy. Each leak check looks at its own pytest process's children only.
TEST_PROCESSES ?= 3

test: check
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --durations=10

test-fast: check
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) -m "not slow"

bench: setup
	$(BIN)/python -m ripples.bench.preduce
	$(BIN)/ripples bench

clean:
	rm -rf $(VENV) runs build *.egg-info

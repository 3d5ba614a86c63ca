# Two commands do all the set-up on a fresh machine:
#   make run   - create .venv if missing, install, run the default experiment
#   make test  - same set-up, then the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export WANDB_SILENT := true
export PYTHONUNBUFFERED := 1
# pytest workers: the tests run one torch thread each (tests/conftest.py), so one per core.
TEST_WORKERS ?= 2

.PHONY: install run test test-all bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python -m specdec.run $(ARGS)

test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow and not gpu" $(ARGS)

test-all: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(ARGS)

bench: install
	$(BIN)/python experiments/bench/ar.py quick=true
	$(BIN)/python experiments/bench/spec.py quick=true

clean:
	rm -rf $(VENV) outputs multirun wandb .pytest_cache

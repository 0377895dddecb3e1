# Switchyard: setup, test, run. Everything installs into .venv at the repository root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test run proto lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

run: setup
	$(BIN)/switchyard up

proto: setup
	$(BIN)/python -m engine_agent.proto_gen.regen

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/sim_iteration_time.py

clean:
	rm -rf $(VENV) build *.egg-info

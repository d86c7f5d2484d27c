#!/usr/bin/env bash
# Usage: bash scripts/gpu_check.sh [--cpu] [--out DIR] [--steps 24] [--only CHECK,...]
#
# The GPU check (scripts/gpu_check.py): run it on a machine with one NVIDIA GPU, from a
# copy of this repository, with the python that holds torch with CUDA (PYTHON=...). It
# installs nothing and reaches no network; models and data are built locally. --cpu runs
# the same checks on the CPU, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec timeout 480 "$PYTHON" scripts/gpu_check.py "$@"

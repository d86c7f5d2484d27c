#!/usr/bin/env bash
# Usage: bash scripts/gpu_replica.sh OUT   (PY312=... picks the Python 3.12; VENV=... the venv)
#
# Rehearses a lent GPU's session on this CPU with that machine's software, before the
# machine is lent: its ~15 minutes must not go on an import or an API that differs from
# this venv's. It builds (once) a venv like the GPU machine's Python (KINDS.md of the
# device tool, read 2026-11): Python 3.12, torch 2.11.0 (PyPI's CUDA 13 build, which runs
# on a CPU), transformers 5.17.0, tokenizers 0.23.2, safetensors 0.8.0, huggingface_hub
# 1.33.0, numpy 2.5.2, and the other packages areal needs that the machine has (typer,
# rich, pyyaml, aiohttp, httpx, matplotlib, jinja2, pytest). It leaves out what it lacks
# (datasets, math-verify, openai, isal, tensorboardX, ray, vllm, sglang), so a path
# that imports one of them fails here as it would there. Then it runs both commands of
# scripts/gpu_session.sh with --cpu in it: OUT/check.log, OUT/bench-*.log.
#
# The first run downloads about 4 GB from PyPI (torch's CUDA build and NVIDIA's libraries)
# into VENV (default: $AREAL_CACHE_DIR or ~/.cache/areal, then gpu-replica); later runs
# reuse it. Not part of `make test` (it downloads); run it after a change to what a GPU
# session runs. The GPU's own kernels (CUDA graphs, varlen attention, NCCL) still only run
# on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-}"
if [[ -z "$out" || "$out" == -* ]]; then
    echo "usage: bash scripts/gpu_replica.sh OUT" >&2
    exit 2
fi
cache="${AREAL_CACHE_DIR:-$HOME/.cache/areal}"
venv="${VENV:-$cache/gpu-replica}"
stamp="$venv/.areal-gpu-replica"  # what the venv was built with; a venv without it is not ours
if [[ -e "$venv" && ! -f "$stamp" ]]; then
    echo "gpu_replica: $venv exists and is not a venv this script built; set VENV to another folder" >&2
    exit 2
fi
is312() { [[ -n "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
if [[ -z "${PY312:-}" ]]; then  # python3.12 on the PATH (a pyenv shim may not run), or pyenv's
    for candidate in "$(command -v python3.12 || true)" \
        $(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12*/bin/python 2>/dev/null); do
        if is312 "$candidate"; then PY312="$candidate"; break; fi
    done
fi
if ! is312 "${PY312:-}"; then
    echo "gpu_replica: no Python 3.12 found (the GPU machine's); set PY312=/path/to/python3.12" >&2
    exit 2
fi

# The GPU machine's versions; the others are whatever pip picks (the machine's are recent).
PINNED=(torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0
        huggingface_hub==1.33.0 numpy==2.5.2)
OTHERS=(typer rich pyyaml aiohttp httpx matplotlib jinja2 pytest)
ABSENT=(datasets math_verify openai isal tensorboardX ray vllm sglang)
want="${PINNED[*]} ${OTHERS[*]}"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "[gpu_replica] building $venv with $("$PY312" --version) (downloads ~4 GB the first time)"
    rm -rf "$venv"
    "$PY312" -m venv "$venv"
    echo "unfinished" > "$stamp"  # ours from now on: a build that fails is redone next run
    pip=("$venv/bin/python" -m pip install --quiet)
    # This machine's pip config names local folders that may be missing, and pip says so
    # per package: those lines are dropped. A failing pip stops the script (pipefail).
    "${pip[@]}" --upgrade pip 2>&1 | { grep -v "^WARNING: Location" || true; }
    "${pip[@]}" "${PINNED[@]}" "${OTHERS[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
    "$venv/bin/python" -c "import torch, transformers" # the install failed if this does
    echo "$want" > "$stamp"
fi
"$venv/bin/python" - "${ABSENT[@]}" <<'EOF'
import importlib.util, sys
present = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is not None]
if present:
    sys.exit(f"gpu_replica: the venv has {', '.join(present)}, which the GPU machine lacks")
print("[gpu_replica] absent, as on the GPU machine: " + ", ".join(sys.argv[1:]))
EOF
mkdir -p "$out"
status=0
for what in check bench; do
    PYTHON="$venv/bin/python" bash scripts/gpu_session.sh "$what" "$out" --cpu >/dev/null || status=1
done
logs=("$out"/check.log "$out"/bench-*.log)
grep -h -E "^python |gpu_check exit|gpu_bench --part|  FAIL  " "${logs[@]}"
if [[ $status != 0 ]]; then
    echo "[gpu_replica] something failed: see ${logs[*]}" >&2
    exit 1
fi
echo "[gpu_replica] every part passed on the GPU machine's software (on this CPU)"

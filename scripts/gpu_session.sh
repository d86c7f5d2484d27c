#!/usr/bin/env bash
# Usage: bash scripts/gpu_session.sh check|bench OUT [--cpu]
#
# A lent GPU's session, prepared: two commands, each under the device tool's 10-minute
# limit per command (run `check`, read it, then `bench`; give the machine back after).
#   check  what the machine is (GPU, driver, python, torch, transformers), then
#          scripts/gpu_check.sh --out OUT/gpu-check (every path one GPU runs; its own
#          limit is 480 s, and OUT/gpu-check/summary.txt holds the rows done so far)
#          -> OUT/check.log
#   bench  scripts/gpu_bench.py --part engine (issue 44; cut at 300 s), then
#          --part trainer (issue 45; cut at 240 s)
#          -> OUT/bench-engine.log, OUT/bench-trainer.log
# gpu_bench prints each row as it is measured, so a part cut short keeps what it measured.
# Exits 1 when a part failed or was cut short (the other part still runs), else 0.
# --cpu rehearses both on the CPU with the tiny models (what CI runs of each script).
# PYTHON picks the interpreter (default: .venv/bin/python here, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-}" out="${2:-}" cpu="${3:-}"
if [[ "$what" != check && "$what" != bench ]] || [[ -z "$out" ]] || [[ -n "$cpu" && "$cpu" != --cpu ]]; then
    echo "usage: bash scripts/gpu_session.sh check|bench OUT [--cpu]" >&2
    exit 2
fi
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHON PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
status=0  # 1 when a part failed or was cut short (each part runs all the same)

machine() {
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    git log -1 --format="commit %h %s" 2>/dev/null || true
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    lscpu | grep -m1 "Model name" || true
    "$PYTHON" -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__)"
}

if [[ "$what" == check ]]; then
    { machine; bash scripts/gpu_check.sh $cpu --out "$out/gpu-check"; rc=$?; echo "gpu_check exit $rc"; exit $rc; } 2>&1 | tee "$out/check.log" || status=1
else
    for part in engine:300 trainer:240; do
        name="${part%%:*}" limit="${part##*:}"
        { machine; timeout "$limit" "$PYTHON" scripts/gpu_bench.py --part "$name" $cpu; rc=$?; echo "gpu_bench --part $name: exit $rc (124 means it was cut at ${limit} s)"; exit $rc; } 2>&1 | tee "$out/bench-$name.log" || status=1
    done
fi
exit $status

"""Only the engine's scheduler thread runs torch's parallel CPU kernels (inference.threads).

OpenMP gives each thread that runs a parallel kernel a team of workers of its own; with
more of them than cores, libgomp stops its idle workers spinning and every small kernel
waits for a wake-up (a decode step twice as slow on a 2-core Xeon). The engine is built
in a fresh process with 3 torch threads, reads a new weight version ahead on its watcher
thread and decodes: the threads that are not Python's (OpenMP's workers) must be the
scheduler's 2, whichever thread built the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from areal_cli.inference import threads

SCRIPT = r"""
import json, os, sys, threading, time
from pathlib import Path

import torch

torch.set_num_threads(3)
from areal_cli.inference.api import GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine
from areal_cli.inference.threads import one_core
from areal_cli.rundir import handoff


def foreign():
    ours = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - ours


def started_by(fn):
    before, seen = foreign(), []

    def run():
        fn()
        seen.append(len(foreign() - before))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def kernel():
    x = torch.ones(1 << 22)
    (x + x).sum()


def quiet_kernel():
    one_core()
    kernel()


model, alt, weights = sys.argv[1:4]
result = {"plain thread": started_by(kernel), "one_core thread": started_by(quiet_kernel)}
result["main's threads"] = torch.get_num_threads()
before = foreign()
engine = InferenceEngine(model, dtype="bfloat16", device="cpu", max_running_requests=4)
engine.watch_for_weights(weights, poll_s=0.05)
files = sorted(p for p in Path(alt).iterdir() if p.is_file())
write = lambda tmp: [handoff.link_or_copy(f, tmp) for f in files]
entry = handoff.write_entry(Path(weights), "v1", 1, write).path
deadline = time.monotonic() + 30
while engine.read_ahead_folder != entry and time.monotonic() < deadline:
    time.sleep(0.01)
result["read ahead"] = engine.read_ahead_folder == entry
ok, message, _ = engine.update_weights_from_disk(entry, "1")
params = SamplingParams(max_new_tokens=8, ignore_eos=True)
for _ in range(4):
    engine.generate_sync(GenerateRequest(input_ids=[5, 6, 7, 8], sampling_params=params), 60)
result["engine"] = len(foreign() - before)
engine.shutdown()
print(json.dumps(result))
"""


@pytest.mark.slow  # a process of its own
def test_only_the_scheduler_thread_starts_openmp_workers(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, tmp_path: Path
) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(tiny_model_dir_alt), str(weights)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # the counting works: a thread running a parallel kernel starts 2 workers, and none
    # after one_core, which leaves the other threads' count as it was
    assert seen["plain thread"] == 2 and seen["one_core thread"] == 0, seen
    assert seen["main's threads"] == 3, seen
    assert seen["read ahead"], seen
    assert seen["engine"] == 2, seen  # the scheduler's team, and no other


def test_one_core_without_openmps_symbol_falls_back_to_torchs_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where OpenMP's omp_set_num_threads is not in reach (or is not torch's runtime), the
    thread still ends up with one thread, through torch's own setting."""
    monkeypatch.setattr(threads, "_omp_set_num_threads", lambda: None)
    main = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []

    def side() -> None:
        threads.one_core()
        seen.append(torch.get_num_threads())

    try:
        thread = threading.Thread(target=side)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(main)  # the default of later threads, as it was
    assert seen == [1]

"""A trainer rank killed mid-run (kill -9): the controller relaunches the trainer from the
newest recover checkpoint and the run finishes, each step in metrics.jsonl exactly once.
(SFT's relaunch, whose final weights equal an uninterrupted run's, is in test_sft.py,
beside the run it compares with.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from areal_cli.rundir import handoff
from tests.conftest import REPO
from tests.e2e.test_train import (
    _args,
    _assert_no_processes_left,
    _metrics,
    _processes_of,
    _run_dir,
    _wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _kill_rank_after_recover(args: list[str], run_dir: Path, rank: int) -> str:
    """Run `args`, kill -9 trainer rank `rank` as soon as the first recover entry exists
    (the run has most of its steps left); returns the run's output (it must finish by
    itself)."""
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    beat = run_dir / "heartbeat" / f"trainer-{rank}.json"

    def ready() -> bool:
        return beat.exists() and handoff.latest(run_dir / "recover", "step-") is not None

    try:
        _wait_for(ready, 300, proc)
        os.kill(json.loads(beat.read_text())["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def test_rl_relaunched_after_a_rank_dies_does_each_step_once(tmp_path: Path) -> None:
    """(The distributed weight update's relaunch, where the new trainer forms a new group,
    is left to scripts/chaos_train.py --set actor.weight_update.method=distributed: the
    server's restart below covers the same regrouping at half the suite's time.)"""
    run_dir = _run_dir(tmp_path)
    args = _args(tmp_path, 6, "recover.freq_steps=2", "rollout.max_staleness=1")
    out = _kill_rank_after_recover(args, run_dir, rank=0)
    assert "relaunching the trainer from" in out
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["trainer_restarts"] == 1
    assert rows[-1]["weight_version"] == 6  # the last step's weights reached the servers
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    _assert_no_processes_left(run_dir)


def _server_pid(run_dir: Path) -> int:
    for pid in _processes_of(run_dir):
        if b"areal_cli.inference.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no server process")


def _ask_server(pid: int, path: str) -> dict:
    """GET `path` of a running embedded server, found through its command line (--port)
    and environment (AREAL_API_KEY)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    port = argv[argv.index("--port") + 1]
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if env.get("AREAL_API_KEY"):
        request.add_header("Authorization", f"Bearer {env['AREAL_API_KEY']}")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _served_version(pid: int) -> int:
    """The weight version a running embedded server reports (GET /model_info)."""
    return int(_ask_server(pid, "/model_info")["weight_version"])


def _when_released(pid: int, timeout_s: float = 60) -> None:
    """Return once a colocated server has released its memory (a training turn)."""
    deadline = time.monotonic() + timeout_s
    while not _ask_server(pid, "/server_info").get("memory_released"):
        assert time.monotonic() < deadline, "the server never released its memory"
        time.sleep(0.005)


LAYOUTS = {
    "disk": ["rollout.max_staleness=1"],
    "distributed": ["rollout.max_staleness=1", "actor.weight_update.method=distributed"],
    "colocated": ["allocation_mode=embedded:d1|fsdp:d1", "rollout.max_staleness=0"],
    # each version an adapter: the restarted server loads the current one before traffic
    "lora": ["rollout.max_staleness=1", "actor.use_lora=true", "actor.lora_rank=8"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_server_is_restarted_with_the_current_weights(tmp_path: Path, layout: str) -> None:
    """Under the distributed method the trainer's next send fails on the dead server, so
    it forms a new group, which the restarted server joins: it takes traffic once it has
    received that version whole. Colocated, a server that dies while the trainer steps
    starts again at the next rollout turn (rollout.phases)."""
    run_dir = _run_dir(tmp_path)
    # enough steps that the kill, after the second one, lands well before the end: a
    # step of the tiny model takes ~0.1 s here
    steps = 16
    args = _args(tmp_path, steps, *LAYOUTS[layout])
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 2, 300, proc)
        # what the server held, not the newest published: a version the trainer has just
        # written may not be loaded yet, and a restart loads what the live servers hold
        pid = _server_pid(run_dir)
        held = _served_version(pid)
        if layout == "colocated":  # in a training turn: it restarts once the trainer gave back
            _when_released(pid)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "server-0 exited with code -9" in out and "restarting it" in out, out[-4000:]
    back = [line for line in out.splitlines() if "server-0 restarted; it serves v" in line]
    assert len(back) == 1, out[-4000:]
    served = int(back[0].rsplit("v", 1)[1])
    assert served >= held  # the newest weights the servers held when it died, or newer
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["server_restarts"] == 1 and "requests_reissued" in rows[-1]
    _assert_no_processes_left(run_dir)


def test_a_colocated_trainer_killed_in_its_training_turn_takes_its_turn_again(
    tmp_path: Path,
) -> None:
    """Colocated, the trainer killed while it steps (the server has released its memory):
    the relaunched trainer takes its turn like the first one, the servers are resumed
    and loaded once it has given the devices back, and the run finishes. (Before, the new
    rollout loop sent generation to the released server, and the run stalled until the
    watchdog stopped it.)"""
    run_dir = _run_dir(tmp_path)
    steps = 10
    args = _args(tmp_path, steps, *LAYOUTS["colocated"], "recover.freq_steps=1")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 2, 300, proc)
        _when_released(_server_pid(run_dir))  # a training turn
        beat = json.loads((run_dir / "heartbeat" / "trainer-0.json").read_text())
        os.kill(beat["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "relaunching the trainer from" in out, out[-4000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["trainer_restarts"] == 1 and all(r["colocated"] == 1 for r in rows)
    _assert_no_processes_left(run_dir)

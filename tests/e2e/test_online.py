"""Online RL end to end: `areal train recipes/tiny_online.yaml` waits for sessions, and
scripts/online_client.py drives them from outside, with nothing but HTTP and the OpenAI
SDK: 64 sessions at once, every sixth abandoned without a reward (a crashed client). The
run trains its 3 steps on the sessions that ended, times the abandoned ones out, and
accounts for every session once. (The learning run is in the README.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.e2e.test_train import _assert_no_processes_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_64_sessions_with_a_sixth_abandoned_train_3_steps_each_counted_once(
    tmp_path: Path,
) -> None:
    log = (tmp_path / "train.log").open("w")
    train = subprocess.Popen(
        [
            sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_online.yaml",
            f"cluster.fileroot={tmp_path}", "total_train_steps=3", "logging.display=plain",
            "logging.tensorboard=false", f"launcher.trainer_port={free_port()}",
            "rollout.group_size=1", "actor.adv_estimator=reinforce_pp",
            "rollout.batch_size=18", "rollout.max_staleness=2", "rollout.session_timeout_s=3",
        ],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    run_dir = tmp_path / "tiny-online" / "trial0"
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "proxy.json").exists():  # the run is up and waits for sessions
            assert train.poll() is None, (tmp_path / "train.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the run did not open its proxy in 300 s"
            time.sleep(0.5)
        client = subprocess.run(
            [
                sys.executable, "scripts/online_client.py", str(run_dir), "--admin-key",
                "areal-online-demo", "--concurrency", "64", "--sessions", "64", "--abandon", "6",
            ],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        # a client that failed or lost a session leaves the run waiting for sessions
        said = client.stdout[-2000:] + client.stderr[-3000:]
        assert client.returncode == 0, said
        assert "64 sessions started, 54 ended, 10 abandoned, 0 lost" in client.stdout, said
        train.wait(timeout=300)
    finally:
        train.kill()
        log.close()
    out = (tmp_path / "train.log").read_text()
    assert train.returncode == 0, out[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = sum(
        r["online_sessions"] - r["online_timeouts"] - r["online_no_reward"] - r["online_empty"]
        for r in rows
    )
    assert trained == 54  # each ended session trained once, in one of the 3 steps
    assert sum(r["dropped_stale"] for r in rows) == 0
    summary = json.loads((run_dir / "online.json").read_text())
    assert summary["started"] == 64 and summary["ended"] == 54
    assert summary["timed_out"] + summary["open_at_end"] == 10  # the abandoned ones
    counted_timeouts = sum(r["online_timeouts"] for r in rows)
    # a timeout is in the steps' figures unless it came after the last batch
    assert summary["counted_in_steps"] == 54 + counted_timeouts
    assert summary["after_last_batch"] == 10 - counted_timeouts
    assert not (run_dir / "proxy.json").exists()  # its address closed with the run
    assert "online: 64 sessions started" in out
    _assert_no_processes_left(run_dir)

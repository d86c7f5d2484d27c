"""A member of the weight-update group dies in the middle of a send: gloo does not notice
(the send waits out the group's timeout: measured 30 s of 30 on this machine), so the
controller, which restarts the server, marks the group (`mark_left`) and the trainer's
rank 0 aborts it at once; its next group meets on a free port, since the aborted store
keeps the old one. A real receiver process, killed with -9 while ~1.6 GB is in flight."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_cli.rundir.weight_group import Group, GroupSpec, mark_left, member_left
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.gloo]

RECEIVER = """
import sys, json, time, torch
from areal_cli.rundir.weight_group import Group, GroupSpec
spec = GroupSpec(**json.loads(sys.argv[1]))
group = Group(spec, 1)
tensors = [torch.empty(100_000_000) for _ in range(4)]
import torch.distributed as dist
opts = dist.BroadcastOptions(); opts.rootRank = 0; opts.rootTensor = 0
works = [group.pg.broadcast([t], opts) for t in tensors]
print("receiving", flush=True)
time.sleep(600)
"""


def test_a_send_to_a_member_that_died_ends_when_the_controller_says_so(tmp_path: Path) -> None:
    import json

    import torch

    spec = GroupSpec("127.0.0.1", free_port(), 2, "gloo", 30.0)
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, json.dumps(spec.to_json())],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        group = Group(spec, 0)
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "receiving"
        tensors = [torch.ones(100_000_000) for _ in range(4)]
        token = "t1"

        def controller() -> None:  # sees the server die, as ServerRecovery.down does
            time.sleep(0.3)  # the send is under way
            os.killpg(receiver.pid, signal.SIGKILL)
            receiver.wait()
            mark_left(tmp_path, token)

        threading.Thread(target=controller, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="died during the send|Connection closed"):
            group.broadcast(tensors, lambda: member_left(tmp_path, token))
        assert time.monotonic() - start < 10  # not the group's 30 s timeout
        group.close()
        # the next group: the aborted one's store still holds its port, so a free one
        again = Group(dataclasses.replace(spec, world_size=1, master_port=0), 0)
        assert again._store.port not in (0, spec.master_port)
        again.close()
    finally:
        if receiver.poll() is None:
            os.killpg(receiver.pid, signal.SIGKILL)
            receiver.wait()

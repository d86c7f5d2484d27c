"""The collectives guard that every gloo test's ranks run under (tests/gloo/guard.py): it
lets the collectives of areal_cli.trainer.collectives and of torch's own FSDP2/DTensor
through, and fails one that areal code issues anywhere else (as `agree_on_plans` did
with a host tensor, which crashed every GPU run under NCCL)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.gloo

PROBE = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from tests.gloo import guard
    guard.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from areal_cli.trainer import collectives
    assert collectives.reduce_values([1.0, torch.tensor(2.0)]) == [1.0, 2.0]
    collectives.barrier()
    print("owner passes")
    # the same call as if written in the trainer's step module, where the bug was
    code = compile("dist.all_reduce(torch.tensor([3]))", "{repo}/areal_cli/trainer/step.py", "exec")
    try:
        exec(code, {{"dist": dist, "torch": torch}})
    except AssertionError as err:
        print(err)
    else:
        print("not caught")
    """
)


def test_the_guard_fails_a_collective_outside_the_owner() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(port=free_port(), repo=REPO)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "owner passes"
    assert lines[1].startswith(
        "collectives guard: all_reduce issued from areal_cli/trainer/step.py:1"
    ), lines

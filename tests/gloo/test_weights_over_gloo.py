"""The distributed weight update end to end below the CLI: real torchrun ranks (FSDP2 and
TP, even and uneven shards) send a version over gloo to two real embedded servers, which
the controller's GroupSync has join and receive; each server then holds the trainer's
weights bit for bit (the CRC-32 its /weights_checksum computes equals the exported
model.safetensors' in the manifest)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from areal_cli.inference.client import InferenceClient
from areal_cli.rollout.state import LoopState
from areal_cli.rollout.sync import GroupPlan, GroupSync
from areal_cli.rundir import handoff
from areal_cli.rundir.weight_group import GroupSpec
from tests.conftest import REPO, free_port
from tests.gloo.conftest import torchrun_argv
from tests.inference.test_server import Server, serve

pytestmark = [pytest.mark.slow, pytest.mark.gloo]
PROBE = REPO / "tests" / "gloo" / "weight_group_probe.py"


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Server]]:
    root = tmp_path_factory.mktemp("roots")
    with ExitStack() as stack:
        yield [
            stack.enter_context(_running(serve(tiny_model_dir, "--weight-root", str(root))))
            for _ in range(2)
        ]


class _running:
    """A `serve` generator as a context manager."""

    def __init__(self, gen: Iterator[Server]) -> None:
        self.gen = gen

    def __enter__(self) -> Server:
        return next(self.gen)

    def __exit__(self, *exc: object) -> None:
        for _ in self.gen:
            pass


# FSDP2 over 3 ranks (uneven rows: the tiny model's 128 and 384 do not split in 3) and TP
# over 2: an even FSDP2 split takes the same path as the uneven one
@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (3, 1)], ids=["d1t2", "d3"])
def test_servers_receive_the_trainers_weights_bit_for_bit(
    servers: list[Server], tiny_model_dir: Path, tmp_path: Path, dp: int, tp: int
) -> None:
    weights, out = tmp_path / "weights", tmp_path / "out"
    spec = GroupSpec("127.0.0.1", free_port(), 1 + len(servers), "gloo", 60.0)
    probe = subprocess.Popen(
        torchrun_argv(dp * tp, str(PROBE), str(tiny_model_dir), str(weights), str(out),
                      json.dumps(spec.to_json()), str(dp), str(tp)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    ranks = {s.url: 1 + i for i, s in enumerate(servers)}
    asyncio.run(_receive_v1(GroupPlan(spec, ranks), weights, probe))
    log, _ = probe.communicate(timeout=120)
    assert probe.returncode == 0, log
    entry = handoff.read_entry(weights / "v1")
    assert entry.meta["method"] == "distributed" and len(entry.meta["buckets"]) > 1
    exported = handoff.read_entry(out / "v1").manifest["files"]
    expected = next(f["crc32"] for f in exported if f["name"] == "model.safetensors")
    for server in servers:
        status, answer = server.call("/weights_checksum")
        assert status == 200 and answer == {"crc32": expected, "weight_version": "1"}


async def _receive_v1(group: GroupPlan, weights: Path, probe: subprocess.Popen) -> None:
    """The controller's side: join the trainer's group and receive v1 on both servers."""
    client = InferenceClient(list(group.ranks), backend="embedded", retries=0)
    state = LoopState(version=0, next_step=1)
    sync = asyncio.create_task(GroupSync(client, weights, state, group, 60.0).run())
    try:
        for _ in range(1200):
            if state.version == 1:
                return
            if sync.done():
                sync.result()  # raises what stopped it
            if probe.poll() not in (None, 0):
                raise AssertionError(f"probe failed:\n{probe.stdout.read()}")
            await asyncio.sleep(0.1)
        raise AssertionError(f"the servers did not receive v1:\n{probe.stdout.read()}")
    finally:
        sync.cancel()
        await asyncio.gather(sync, return_exceptions=True)
        await client.close()

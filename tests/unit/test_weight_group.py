"""The distributed weight update's protocol, plan and rules, without a process: bucket
order and sizes, the request bodies against SGLang's own request types, the group the
plan makes (ranks, port, backend), what --dry-run and validation say."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from areal_cli.config.loader import load_config
from areal_cli.config.rules import check_config
from areal_cli.inference.backends import backend_for
from areal_cli.launch.plan import Ports, build_plan
from areal_cli.rundir.weight_group import GroupSpec, buckets, update_body
from tests.conftest import REPO, areal_in_process

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _sglang_fields() -> dict[str, dict[str, bool]]:
    """SGLang's request types: field -> required, per type (tests/assets)."""
    fields: dict[str, dict[str, bool]] = {}
    for line in (ASSETS / "sglang_weight_requests.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            kind, name, need = line.split("\t")
            fields.setdefault(kind, {})[name] = need == "required"
    return fields


def test_request_bodies_are_sglangs_request_types() -> None:
    """Every field we send exists in SGLang's type, and every required one is sent."""
    spec = GroupSpec("10.0.0.1", 29600, 5, "nccl", 600.0)
    bodies = {
        "InitWeightsUpdateGroupReqInput": spec.init_body(rank_offset=3),
        "UpdateWeightsFromDistributedReqInput": update_body([("w", "bfloat16", [2, 3])], "7"),
    }
    sglang = _sglang_fields()
    for kind, body in bodies.items():
        fields = sglang[kind]
        assert set(body) <= set(fields), (kind, set(body) - set(fields))
        assert {f for f, required in fields.items() if required} <= set(body), kind
    assert bodies["InitWeightsUpdateGroupReqInput"]["rank_offset"] == 3
    last = bodies["UpdateWeightsFromDistributedReqInput"]
    assert last["dtypes"] == ["bfloat16"] and last["weight_version"] == "7"
    assert update_body([("w", "float32", [1])], None)["weight_version"] is None


def test_buckets_keep_the_order_and_the_size() -> None:
    metas = [(f"t{i}", "float32", [256]) for i in range(10)]  # 1 KiB each
    metas.insert(4, ("big", "bfloat16", [4096]))  # 8 KiB: a bucket of its own
    plan = buckets(metas, bucket_bytes=3 * 1024)
    assert [m for b in plan for m in b] == metas  # every tensor once, in order
    assert [len(b) for b in plan] == [3, 1, 1, 3, 3]
    assert buckets([], 1024) == []


def _plan(*overrides: str):
    loaded = load_config(REPO / "recipes" / "tiny_cpu.yaml", list(overrides))
    result = check_config(loaded)
    assert not result.problems, [p.format() for p in result.problems]
    cfg, mode = loaded.config, result.allocation
    ports = Ports(tuple(30000 + i for i in range(mode.n_servers)), 0, 29700)
    return build_plan(cfg, mode, ports=ports, run_id="r1", python="/py/bin/python", cpu_count=4)


@pytest.mark.parametrize("method", ["distributed", "xccl"])
def test_the_plan_makes_the_group_and_hands_it_to_every_member(method: str) -> None:
    plan = _plan(
        f"actor.weight_update.method={method}",
        "allocation_mode=embedded:d2+fsdp:d2",
        "cluster.n_cpus=4",
        "trainer.collective_timeout_s=90",
    )
    group = GroupSpec.from_json(plan.weight_group)
    assert group == GroupSpec("127.0.0.1", 29700, 3, "gloo", 90.0)
    assert plan.group_ranks == {"server-0": 1, "server-1": 2}
    trainer = next(p for p in plan.processes if p.name == "trainer")
    given = trainer.argv[trainer.argv.index("--weight-group") + 1]
    assert GroupSpec.from_json(json.loads(given)) == group
    for server in (p for p in plan.processes if p.name.startswith("server")):
        assert server.argv[server.argv.index("--dist-timeout") + 1] == "90"
    assert json.loads(json.dumps(plan.to_dict()))["weight_group"]["world_size"] == 3


def test_the_disk_plan_has_no_group() -> None:
    plan = _plan()
    assert plan.weight_group is None and plan.group_ranks == {}
    assert all("--weight-group" not in p.argv and "--dist-timeout" not in p.argv
               for p in plan.processes)  # fmt: skip


def test_an_sglang_gpu_plan_counts_every_tp_rank() -> None:
    loaded = load_config(
        REPO / "recipes" / "gsm8k_grpo.yaml", ["actor.weight_update.method=distributed"]
    )
    result = check_config(loaded)
    cfg, mode = loaded.config, result.allocation
    ports = Ports(tuple(30000 + i for i in range(mode.n_servers)), 0, 29700)
    plan = build_plan(cfg, mode, ports=ports, run_id="r1", python="/py/bin/python")
    tp = mode.inference.tensor_parallel_size
    assert plan.weight_group["backend"] == "nccl"
    assert plan.weight_group["world_size"] == 1 + mode.n_servers * tp
    assert list(plan.group_ranks.values()) == [1 + i * tp for i in range(mode.n_servers)]
    server = next(p for p in plan.processes if p.name == "server-0")
    assert "--dist-timeout" in server.argv  # SGLang's own flag (tests/assets/sglang_flags.txt)


def test_a_vllm_gpu_plan_makes_vllms_group() -> None:
    """gsm8k_grpo.yaml with vLLM (t2 servers): vLLM's engine and the trainer's vLLM helper
    make the group (protocol pynccl); every worker of a server has its own rank."""
    loaded = load_config(
        REPO / "recipes" / "gsm8k_grpo.yaml",
        ["actor.weight_update.method=xccl", "allocation_mode=vllm:d2t2+fsdp:d4"],
    )
    result = check_config(loaded, launch=False, backends=backend_for)
    assert not result.problems, [p.format() for p in result.problems]
    cfg, mode = loaded.config, result.allocation
    plan = build_plan(cfg, mode, ports=Ports((30000, 30001), 0, 29700), run_id="r1", python="/py")
    group = GroupSpec.from_json(plan.weight_group)
    assert (group.protocol, group.backend, group.world_size) == ("pynccl", "nccl", 5)
    assert plan.group_ranks == {"server-0": 1, "server-1": 3}
    server = next(p for p in plan.processes if p.name == "server-1")
    assert server.argv[server.argv.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    # a launch needs vllm where the trainer runs (this suite's Python has none: make vllm
    # puts it in a venv of its own)
    if importlib.util.find_spec("vllm") is None:
        launch = check_config(loaded, launch=True, backends=backend_for).problems
        assert any("the trainer joins vLLM's weight-transfer group" in p.format() for p in launch)


def test_under_slurm_rank_0_says_where_the_group_meets(tmp_path: Path) -> None:
    """The plan names the trainer's first node (HEAD_NODE, which the Slurm runner fills in
    the trainer's command line); torchrun's rendezvous may put rank 0 on another node, so
    rank 0 announces its own address with the group, and the controller uses that."""
    from areal_cli.launch.plan import HEAD_NODE
    from areal_cli.rundir.weight_group import (
        Announced,
        announce_group,
        announced_group,
        mark_left,
        member_left,
        own_address,
    )

    plan = _plan(
        "actor.weight_update.method=distributed",
        "launcher.type=slurm",
        "cluster.n_nodes=2",
        "allocation_mode=embedded:d2+fsdp:d2",
    )
    assert plan.weight_group["master_address"] == HEAD_NODE
    trainer = next(p for p in plan.processes if p.name == "trainer")
    assert HEAD_NODE in trainer.argv[trainer.argv.index("--weight-group") + 1]
    assert announced_group(tmp_path) == Announced()
    announce_group(tmp_path, "t1", own_address("127.0.0.1"), 29700)
    assert announced_group(tmp_path) == Announced("t1", "127.0.0.1", 29700)
    assert not member_left(tmp_path, "t1")
    mark_left(tmp_path, "t1")  # the controller saw a member die
    assert member_left(tmp_path, "t1") and not member_left(tmp_path, "t2")


def test_dry_run_shows_the_group() -> None:
    result = areal_in_process(
        "train", str(REPO / "recipes" / "tiny_cpu.yaml"), "--dry-run",
        "actor.weight_update.method=distributed",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert (
        "weight update: distributed over gloo (SGLang's weight-update group), group areal_weight_update of 2 on 127.0.0.1:"
        in out
    )
    assert "ranks: trainer rank 0: 0, server-0: 1" in out


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["allocation_mode=vllm:d1+fsdp:d1"],
            "vLLM receives weights over the network with NCCL only",
        ),
    ],
)
def test_what_the_method_refuses(overrides: list[str], says: str) -> None:
    loaded = load_config(
        REPO / "recipes" / "tiny_cpu.yaml", ["actor.weight_update.method=distributed", *overrides]
    )
    problems = [p.format() for p in check_config(loaded, backends=backend_for).problems]
    assert any("actor.weight_update.method" in p and says in p for p in problems), problems


class _NoEngine:
    """The server's engine is never reached on these refusals (error paths only)."""

    tokenizer = None
    weight_version = "0"

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")


@pytest.mark.parametrize(
    ("roots", "path", "body", "says"),
    [
        ([], "/init_weights_update_group", {"master_address": "127.0.0.1"}, "without --weight-root"),
        (["/w"], "/init_weights_update_group", {"master_port": 1}, "bad /init_weights_update_group"),
        (["/w"], "/init_weights_update_group",
         {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 0,
          "backend": "gloo"}, "rank_offset 0 is outside 1..1"),
        (["/w"], "/init_weights_update_group",
         {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 1},
         "backend nccl needs a CUDA device"),
        (["/w"], "/update_weights_from_distributed",
         {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}, "in no weight-update group"),
    ],
)  # fmt: skip
def test_the_embedded_server_refuses_what_it_cannot_join_or_receive(
    roots: list[str], path: str, body: dict, says: str
) -> None:
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from areal_cli.inference.server import InferenceServer

    async def main() -> tuple[int, dict]:
        app = InferenceServer(_NoEngine(), "m", None, roots).app()
        async with TestClient(TestServer(app)) as client:
            resp = await client.post(path, json=body)
            return resp.status, await resp.json()

    status, answer = asyncio.run(main())
    assert status == 400 and answer["success"] is False and says in answer["message"], answer

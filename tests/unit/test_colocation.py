"""Colocated runs (`a|b`): the grammar, the rules and the plan, and the controller's
handover between the turns (areal_cli.rollout.phases) against in-process HTTP servers on
loopback that answer SGLang's memory and weight routes; no process is started."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from areal_cli.config.allocation import AllocationError, parse_allocation
from areal_cli.config.loader import load_config
from areal_cli.config.phase_memory import estimate, param_count
from areal_cli.config.rules import check_config
from areal_cli.inference.backends import backend_for
from areal_cli.launch.plan import build_plan
from areal_cli.rollout.phases import Phases, trainer_gave_back
from areal_cli.rollout.state import LoopState
from areal_cli.rollout.sync import WeightSync
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.paths import RunDir
from tests.conftest import REPO
from tests.unit.test_plan import _plan, _ports
from tests.unit.test_sync import publish, serving

COLOCATED = ("allocation_mode=embedded:d1|fsdp:d1", "rollout.max_staleness=0")


def test_a_bar_shares_the_devices_and_a_plus_keeps_them_apart() -> None:
    assert parse_allocation("embedded:d1|fsdp:d1").colocated
    assert parse_allocation("sglang:d1t2|fsdp:d2").colocated
    assert not parse_allocation("embedded:d1+fsdp:d1").colocated
    for text, words in [
        ("embedded:d1|fsdp:d2", "embedded spans 1 and fsdp 2"),
        ("embedded:d1+fsdp:d1|fsdp:d1", "mixes '+' and '|'"),
        ("fsdp:d1|fsdp:d1", "two train components"),
        ("embedded:d1|", "has no ':dims' part"),
    ]:
        with pytest.raises(AllocationError, match=words):
            parse_allocation(text)


def _problems(*overrides: str) -> list[str]:
    loaded = load_config(REPO / "recipes" / "tiny_cpu.yaml", list(overrides))
    return [p.format() for p in check_config(loaded, backends=backend_for).problems]


def test_the_rules_of_a_colocated_recipe() -> None:
    assert _problems(*COLOCATED) == []
    [line] = _problems("allocation_mode=embedded:d1|fsdp:d1")  # max_staleness 1
    assert "rollout.max_staleness" in line and "set rollout.max_staleness: 0" in line
    [line] = _problems(*COLOCATED, "actor.weight_update.method=distributed")
    assert "set actor.weight_update.method: disk" in line
    [line] = _problems("allocation_mode=vllm:d1|fsdp:d1", "rollout.max_staleness=0")
    assert "sleep mode" in line and "embedded:d1|fsdp:d1" in line
    gpu = ("cluster.n_gpus_per_node=1", "rollout.max_staleness=0")
    assert _problems("allocation_mode=sglang:d1|fsdp:d1", *gpu) == []
    [line] = _problems("allocation_mode=sglang:d1+fsdp:d1", "cluster.n_gpus_per_node=1")
    assert "needs 2 GPUs" in line and "write allocation_mode: 'sglang:d1|fsdp:d1'" in line


def test_the_plan_shares_devices_and_says_so_on_each_command_line() -> None:
    _, _, plan = _plan("tiny_cpu.yaml", *COLOCATED, "cluster.n_cpus=4")
    server, trainer = plan.processes
    assert server.cpus == trainer.cpus == [0, 1, 2, 3]  # each phase has every core
    assert server.env["OMP_NUM_THREADS"] == trainer.env["OMP_NUM_THREADS"] == "4"
    assert trainer.argv[-1] == "--colocated" and plan.allocation.colocated
    _, _, apart = _plan("tiny_cpu.yaml", "cluster.n_cpus=4")
    assert "--colocated" not in apart.processes[-1].argv
    gpu = ("cluster.n_gpus_per_node=1", "rollout.max_staleness=0")
    for backend, flag in [("sglang", "--enable-memory-saver"), ("vllm", "--enable-sleep-mode")]:
        loaded = load_config(
            REPO / "recipes" / "tiny_cpu.yaml", [f"allocation_mode={backend}:d1|fsdp:d1", *gpu]
        )
        mode = parse_allocation(loaded.config.allocation_mode)
        plan = build_plan(
            loaded.config, mode, ports=_ports(loaded.config, mode), run_id="r1", python="/py"
        )
        server, trainer = plan.processes
        assert server.env["CUDA_VISIBLE_DEVICES"] == trainer.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert flag in server.argv


def test_memory_per_phase_is_the_model_s_arithmetic() -> None:
    smollm2 = {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "tie_word_embeddings": True, "max_position_embeddings": 8192,
    }  # fmt: skip
    assert param_count(smollm2) == 134_515_008  # SmolLM2-135M's own count
    loaded = load_config(REPO / "recipes" / "tiny_cpu.yaml", list(COLOCATED))
    memory = estimate(loaded.config, parse_allocation("embedded:d1|fsdp:d1"), smollm2)
    assert memory.server_weights == 134_515_008 * 4  # float32 on the embedded server
    assert memory.trainer_state == 134_515_008 * (4 + 4 + 8)  # params, grads, AdamW
    cfg = loaded.config
    longest = cfg.dataset.max_prompt_len + cfg.gconfig.max_new_tokens  # one turn
    kv_row = 2 * 30 * 3 * 64 * 4 * longest  # K and V, every layer
    rows = min(cfg.inference.embedded.max_running_requests, 16 * 8)  # a batch's samples
    assert memory.server_kv == rows * kv_row


class MemoryRoutes:
    """One SGLang server's memory and weight routes; every call goes into a shared log."""

    def __init__(self, name: str, log: list[tuple[str, str, Any]]) -> None:
        self.name, self.log, self.version = name, log, "0"

    async def release(self, request: web.Request) -> web.Response:
        self.log.append((self.name, "release", (await request.json())["tags"]))
        return web.json_response({"success": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.log.append((self.name, "resume", (await request.json())["tags"]))
        return web.json_response({"success": True})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.version = str(body["weight_version"])
        self.log.append((self.name, "load", self.version))
        return web.json_response({"success": True, "weight_version": self.version})

    async def generate(self, request: web.Request) -> web.Response:
        self.log.append((self.name, "generate", None))
        await asyncio.sleep(0.05)
        meta = {"output_token_logprobs": [[-0.1, 7, None]], "finish_reason": {"type": "length"}}
        return web.json_response({"output_ids": [7], "meta_info": meta})


def colocated_servers(n: int, log: list):
    """`n` servers answering SGLang's memory, weight and generate routes into `log`."""
    servers = [MemoryRoutes(f"s{i}", log) for i in range(n)]
    return serving(
        [
            [
                ("POST", "/release_memory_occupation", r.release),
                ("POST", "/resume_memory_occupation", r.resume),
                ("POST", "/update_weights_from_disk", r.update),
                ("POST", "/generate", r.generate),
            ]
            for r in servers
        ]
    )


def test_the_handover_releases_before_the_batch_and_resumes_around_the_load(
    tmp_path: Path,
) -> None:
    """to_training waits for the request in flight and holds new ones; the load waits for
    the trainer, between the weights' and the KV cache's resume; then requests go on."""
    log: list[tuple[str, str, Any]] = []

    async def test() -> None:
        async with colocated_servers(2, log) as client:
            trainer_busy = True
            phases = Phases(client, lambda: not trainer_busy, poll_s=0.005)
            sync = WeightSync(client, RunDir(tmp_path).weights, LoopState(0, 1), phases)
            first = asyncio.ensure_future(client.generate([1], {}))
            await asyncio.sleep(0.01)  # in flight
            await phases.to_training(1)
            assert first.done() and client.gate.held
            evaluation = client.sibling()
            late = asyncio.ensure_future(evaluation.generate([1], {}))
            publish(tmp_path, 1)
            load = asyncio.ensure_future(sync.load_newest())
            await asyncio.sleep(0.05)
            assert not load.done() and not late.done()  # the trainer still holds the devices
            trainer_busy = False
            assert await load and await late
            await evaluation.close()
            figures = sync.state.handoff[1]
            assert figures["colocated"] == 1 and sync.state.version == 1
            assert {"phase_release_s", "phase_trainer_wait_s", "phase_resume_s"} <= set(figures)

    asyncio.run(asyncio.wait_for(test(), 30))
    for server in ("s0", "s1"):
        calls = [(what, arg) for name, what, arg in log if name == server and what != "generate"]
        assert calls[-4:] == [
            ("release", None), ("resume", ["weights"]), ("load", "1"), ("resume", ["kv_cache"])
        ]  # fmt: skip
    kinds = [what for _, what, _ in log]
    assert kinds.index("release") > kinds.index("generate")  # the first request ended first
    assert kinds[-1] == "generate"  # the held request went out after the handover


def test_a_server_that_died_while_the_trainer_steps_starts_once_it_gave_back(
    tmp_path: Path,
) -> None:
    """ServerRecovery.may_start (what a restart waits for) holds while the trainer holds
    the devices in a training turn, asks `check` meanwhile (another death stops the
    wait), and returns once the trainer gave them back, before the next load (which needs
    a live server: waiting for the load would deadlock a run whose only server died)."""
    from areal_cli.rollout.recovery import ServerRecovery

    log: list[tuple[str, str, Any]] = []
    checks: list[int] = []
    trainer_busy = True

    async def test() -> None:
        nonlocal trainer_busy
        async with colocated_servers(1, log) as client:
            phases = Phases(client, lambda: not trainer_busy, poll_s=0.005)
            sync = WeightSync(client, RunDir(tmp_path).weights, LoopState(0, 1), phases)
            recovery = ServerRecovery(client, RunDir(tmp_path).weights, sync.state, 30, sync)
            await recovery.may_start(lambda: checks.append(1))  # a rollout turn: at once
            await phases.to_training(1)
            start = asyncio.ensure_future(recovery.may_start(lambda: checks.append(1), 0.01))
            await asyncio.sleep(0.2)
            assert not start.done() and checks  # the trainer holds the devices
            trainer_busy = False  # it published v1 and gave them back; nothing loaded yet
            await asyncio.wait_for(start, 5)
            assert sync.state.version == 0

            def died() -> None:
                raise RuntimeError("trainer died")

            trainer_busy = True
            await phases.to_training(2)
            with pytest.raises(RuntimeError, match="trainer died"):
                await recovery.may_start(died, 0.01)

    asyncio.run(asyncio.wait_for(test(), 30))


def test_a_server_back_inside_a_training_turn_releases_like_the_others(tmp_path: Path) -> None:
    """The handover released the live servers; one that comes back before the next load
    releases too (ServerRecovery._match_the_turn), and outside a training turn it does not."""
    from areal_cli.rollout.recovery import ServerRecovery

    log: list[tuple[str, str, Any]] = []

    async def test() -> None:
        async with colocated_servers(2, log) as client:
            phases = Phases(client, lambda: True, poll_s=0.005)
            sync = WeightSync(client, RunDir(tmp_path).weights, LoopState(0, 1), phases)
            recovery = ServerRecovery(client, RunDir(tmp_path).weights, sync.state, 30, sync)
            back = client.servers[1].address
            await recovery._match_the_turn(back)  # a rollout turn: nothing to give back
            assert not log
            client.set_down(back)
            await phases.to_training(1)  # releases s0 only: s1 is down
            await recovery._match_the_turn(back)
            client.set_up(back)

    asyncio.run(asyncio.wait_for(test(), 30))
    assert [(name, what) for name, what, _ in log] == [("s0", "release"), ("s1", "release")]


def test_the_trainer_gives_back_when_every_rank_says_so(tmp_path: Path) -> None:
    assert trainer_gave_back(tmp_path)  # no rank has started
    ranks = [Heartbeat(tmp_path, f"trainer-{r}") for r in range(2)]
    ranks[0].phase("build model")  # a rank holds its devices until it gives them back
    ranks[1].phase("build model")
    assert not trainer_gave_back(tmp_path)
    for rank in ranks:
        rank.holds_devices = False
        rank.phase("devices given back")
    assert trainer_gave_back(tmp_path)
    ranks[1].holds_devices = True
    ranks[1].phase("take the devices")
    assert not trainer_gave_back(tmp_path)

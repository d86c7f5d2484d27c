"""The launch plan is a pure function of the config; its command lines are real."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_cli.config.loader import load_config
from areal_cli.config.rules import check_config
from areal_cli.inference.backends.sglang import sglang_args
from areal_cli.launch.plan import Ports, build_plan, pick_ports, served_name
from tests.conftest import REPO

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _ports(cfg, mode) -> Ports:
    """Fixed stand-ins for the ports a launch picks (pick_ports), so plans compare equal:
    the configured ones, servers from 30000 and a cluster trainer on 29500 where left at 0."""
    base = cfg.launcher.inference_base_port or 30000
    trainer = cfg.launcher.trainer_port or (0 if cfg.launcher.type == "local" else 29500)
    return Ports(tuple(base + i for i in range(mode.n_servers)), trainer)


def _plan(recipe: str, *overrides: str, cpu_count: int = 2):
    loaded = load_config(REPO / "recipes" / recipe, list(overrides))
    result = check_config(loaded)
    assert not result.problems, [p.format() for p in result.problems]
    cfg, mode = loaded.config, result.allocation
    plan = build_plan(
        cfg, mode, ports=_ports(cfg, mode), run_id="r1", python="/py/bin/python",
        cpu_count=cpu_count,
    )  # fmt: skip
    return cfg, mode, plan


def _sglang_flags() -> dict[str, str]:
    lines = (ASSETS / "sglang_flags.txt").read_text().splitlines()
    return dict(line.split("\t") for line in lines if line and not line.startswith("#"))


def test_plan_is_deterministic() -> None:
    assert _plan("tiny_cpu.yaml")[2] == _plan("tiny_cpu.yaml")[2]


def test_gpu_plan_uses_disjoint_gpus_and_real_commands() -> None:
    cfg, _, plan = _plan("gsm8k_grpo.yaml")
    servers = [p for p in plan.processes if p.name.startswith("server")]
    trainer = plan.processes[-1]
    assert len(servers) == 4 and trainer.name == "trainer"
    used = [g for p in plan.processes for g in p.gpus]
    assert sorted(used) == list(range(8)) and len(set(used)) == 8
    assert servers[0].argv[:3] == ["/py/bin/python", "-m", "sglang.launch_server"]
    assert (
        servers[0].env["CUDA_VISIBLE_DEVICES"] == "0"
        and trainer.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    )
    assert [p.ports[0] for p in servers] == [30000, 30001, 30002, 30003]
    assert trainer.argv[:6] == [
        "/py/bin/torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "4",
        "--standalone",  # a free rendezvous port that torchrun binds itself
    ]
    assert trainer.argv[6:8] == ["--log-dir", f"{plan.run_dir}/logs/torchrun"]  # not /tmp
    assert trainer.argv[8:10] == ["-m", "areal_cli.trainer.main"]
    assert trainer.ports == []
    assert plan.run_dir.endswith("gsm8k-grpo/trial0")


def test_a_fixed_trainer_port_is_a_c10d_rendezvous_of_the_run_alone() -> None:
    _, _, plan = _plan("tiny_cpu.yaml", "launcher.trainer_port=29511")
    trainer = plan.processes[-1]
    argv = trainer.argv
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:29511"
    assert argv[argv.index("--rdzv-id") + 1] == "r1" and trainer.ports == [29511]


def test_every_server_carries_the_run_identity() -> None:
    gpus = ("cluster.n_gpus_per_node=4",)
    for allocation, more in (("embedded", ()), ("sglang", gpus), ("vllm", gpus)):
        _, _, plan = _plan(
            "tiny_cpu.yaml", f"allocation_mode={allocation}:d2+fsdp:d1", "cluster.n_cpus=4", *more
        )
        assert plan.served_model == served_name("r1")
        for server in plan.processes[:2]:
            argv = server.argv
            assert argv[argv.index("--served-model-name") + 1] == plan.served_model


def test_ports_left_at_zero_are_free_ones_picked_at_launch() -> None:
    import socket

    loaded = load_config(
        REPO / "recipes" / "tiny_cpu.yaml",
        ["allocation_mode=embedded:d3+fsdp:d1", "cluster.n_cpus=4"],
    )
    mode = check_config(loaded).allocation
    first, second = pick_ports(loaded.config, mode), pick_ports(loaded.config, mode)
    assert len(set(first.servers)) == 3 and first.trainer == 0  # local: torchrun picks its own
    for port in first.servers + second.servers:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    loaded.config.launcher.inference_base_port = 31000
    loaded.config.launcher.type = "slurm"
    fixed = pick_ports(loaded.config, mode)
    assert fixed.servers == (31000, 31001, 31002) and fixed.trainer not in fixed.servers
    assert fixed.trainer > 0


def test_cpu_plan_splits_cores_and_threads() -> None:
    _, _, plan = _plan("tiny_cpu.yaml", "allocation_mode=embedded:d1+fsdp:d2")
    server, trainer = plan.processes
    assert server.cpus == [0] and trainer.cpus == [1]
    assert server.env["OMP_NUM_THREADS"] == "1" and trainer.env["OMP_NUM_THREADS"] == "1"
    assert server.argv[1:3] == ["-m", "areal_cli.inference.server"]
    assert (
        "--nproc-per-node" in trainer.argv
        and trainer.argv[trainer.argv.index("--nproc-per-node") + 1] == "2"
    )


def test_cpu_plan_on_a_bigger_machine() -> None:
    _, _, plan = _plan("tiny_cpu.yaml", "cluster.n_cpus=16", "allocation_mode=embedded:d2+fsdp:d4")
    servers, trainer = plan.processes[:2], plan.processes[2]
    assert servers[0].cpus == [0, 1, 2, 3] and servers[1].cpus == [4, 5, 6, 7]
    assert trainer.cpus == list(range(8, 16)) and trainer.env["OMP_NUM_THREADS"] == "2"


def test_sglang_flags_are_accepted_by_sglang_parser() -> None:
    """Every flag we emit exists in sglang 0.5.23's server_args (tests/assets/sglang_flags.txt)."""
    known = _sglang_flags()
    cfg, mode, _ = _plan(
        "gsm8k_grpo.yaml",
        "inference.sglang.disable_radix_cache=true",
        "inference.sglang.enable_deterministic_inference=true",
        "inference.sglang.enable_metrics=true",
        "inference.sglang.skip_server_warmup=true",
        "inference.sglang.trust_remote_code=true",
        "inference.sglang.max_running_requests=64",
        "inference.sglang.chunked_prefill_size=4096",
        "inference.sglang.attention_backend=fa3",
        "inference.sglang.disable_cuda_graph=true",
        "inference.sglang.cuda_graph_max_bs=32",
        "inference.api_key=sekret",
    )
    args = sglang_args(cfg, mode.inference, "/m", 30000, 0)
    assert "--disable-decode-cuda-graph" in args and "--cuda-graph-max-bs-decode" in args
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in known, f"{flag} is not an sglang flag"
        if known[flag] == "bool":
            i += 1
        else:
            assert not args[i + 1].startswith("--"), f"{flag} needs a value"
            i += 2


def test_the_embedded_server_takes_the_cuda_graph_flags_the_plan_gives_it() -> None:
    """The embedded server's parser accepts SGLang's graph flags (0.5.23's names, and the
    older ones an AReaL user types), and the plan passes the recipe's keys as them."""
    from areal_cli.inference.server import build_parser

    _, _, plan = _plan(
        "tiny_cpu.yaml",
        "inference.embedded.disable_cuda_graph=true",
        "inference.embedded.cuda_graph_max_bs=8",
    )
    args = build_parser().parse_args(plan.processes[0].argv[3:])
    assert args.disable_decode_cuda_graph and args.cuda_graph_max_bs_decode == 8
    old = build_parser().parse_args(
        ["--model-path", "/m", "--disable-cuda-graph", "--cuda-graph-max-bs", "4"]
    )
    assert old.disable_decode_cuda_graph and old.cuda_graph_max_bs_decode == 4
    plain = build_parser().parse_args(plan.processes[0].argv[3:5])
    assert not plain.disable_decode_cuda_graph and plain.cuda_graph_max_bs_decode is None


def test_api_key_is_redacted_in_json() -> None:
    cfg, _, plan = _plan("tiny_cpu.yaml", "inference.api_key=sekret")
    server = plan.processes[0]
    assert "sekret" not in server.argv and "--api-key" not in server.argv  # not in ps
    assert server.env["AREAL_API_KEY"] == "sekret"  # the embedded server reads it there
    assert "sekret" not in plan.to_json(secret="sekret")
    cfg, _, plan = _plan("gsm8k_grpo.yaml", "inference.api_key=sekret")
    assert "sekret" in plan.processes[0].argv  # SGLang takes it only as --api-key
    assert "sekret" not in plan.to_json(secret="sekret")


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_every_recipe_has_a_usage_line(recipe: str) -> None:
    assert (REPO / "recipes" / recipe).read_text().startswith("# Usage: areal ")

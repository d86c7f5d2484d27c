"""LoRA without a process: the recipe's rules, the dry run's memory line, SGLang's LoRA
flags and request bodies against SGLang's own names and types, and the client's choice
of adapter names, retirements and version labels."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from areal_cli.config.allocation import parse_allocation
from areal_cli.config.schema import ExperimentConfig
from areal_cli.inference.backends import BACKENDS
from areal_cli.inference.backends.base import ServerSpec
from tests.conftest import REPO, areal_in_process

ASSETS = Path(__file__).resolve().parents[1] / "assets"
LORA = str(REPO / "recipes" / "tiny_lora.yaml")


def _table(name: str) -> list[list[str]]:
    lines = (ASSETS / name).read_text().splitlines()
    return [line.split("\t") for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("algorithm=ppo", "actor.use_lora: LoRA is built for the RL actor of algorithm: grpo"),
        ("actor.target_modules=[qkv_proj]", "['qkv_proj'] match no linear layer of this llama"),
        ("actor.target_modules=[all-linear,q_proj]", "all-linear must be the only entry"),
        (
            "actor.weight_update.method=distributed allocation_mode=sglang:d1+fsdp:d1",
            "distributed is built for LoRA adapters on the embedded server only, not on sglang",
        ),
        ("allocation_mode=embedded:d1+fsdp:d1t2", "with tensor parallelism (t > 1) is not built"),
    ],
)
def test_what_lora_is_not_built_for_is_refused_in_one_line(override: str, says: str) -> None:
    done = areal_in_process("validate", LORA, *override.split())
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_lora_keys_without_use_lora_warn() -> None:
    done = areal_in_process("validate", LORA, "actor.use_lora=false")
    assert done.returncode == 0
    assert "actor.lora_rank: is read only with actor.use_lora: true" in done.stderr + done.stdout


def test_dry_run_counts_the_optimizer_state_of_the_adapters_only() -> None:
    from areal_cli.config.phase_memory import param_count, trainer_state_bytes

    config = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }  # fmt: skip  (SmolLM2-135M's shape)
    cfg = ExperimentConfig()
    full = trainer_state_bytes(cfg, config, 1)
    assert full == param_count(config) * (4 + 4 + 8)
    cfg.actor.use_lora, cfg.actor.lora_rank = True, 16
    adapters = 30 * 16 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))  # q o, k v, mlp
    assert (
        trainer_state_bytes(cfg, config, 1) == (param_count(config) + adapters) * 4 + adapters * 12
    )
    done = areal_in_process("train", LORA, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert (
        "trainer state per rank:" in done.stdout and "LoRA: gradients and optimizer" in done.stdout
    )


def test_sglang_lora_flags_and_bodies_are_sglangs_own() -> None:
    """Every LoRA flag is one SGLang's launch_server has (a switch where it is one), and
    the load, unload and generate bodies hold only fields of SGLang's request types, with
    every required one."""
    flags = dict(_table("sglang_flags.txt"))
    cfg = ExperimentConfig()
    cfg.actor.use_lora, cfg.actor.lora_rank, cfg.actor.target_modules = (
        True,
        8,
        ["q_proj", "v_proj"],
    )
    sglang = BACKENDS["sglang"]
    args = sglang.lora_args(cfg)
    assert (
        args[:3] == ["--enable-lora", "--max-lora-rank", "8"] and flags["--enable-lora"] == "bool"
    )
    assert args[args.index("--lora-target-modules") + 1 :][:2] == ["q_proj", "v_proj"]
    assert all(flag in flags for flag in args if flag.startswith("--"))
    cfg.actor.target_modules = ["all-linear"]
    assert "all" in sglang.lora_args(cfg)
    server = ServerSpec("/m", 30000, 0, "127.0.0.1", "cuda", "areal-run-x")
    assert "--enable-lora" in sglang.run_args(
        cfg, parse_allocation("sglang:d1+fsdp:d1").inference, server
    )

    fields: dict[str, dict[str, bool]] = {}
    for kind, name, need in _table("sglang_lora_requests.txt"):
        fields.setdefault(kind, {})[name] = need == "required"
    link = _Recorder()
    answer = asyncio.run(sglang.load_adapter(link, "/w/v3", "run-v3", "3", "run-v1"))
    assert answer == {"success": True, "message": "loaded adapter run-v3", "weight_version": "3"}
    assert [path for path, _ in link.calls] == ["/load_lora_adapter", "/unload_lora_adapter"]
    for (_, body), kind in zip(
        link.calls, ("LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput"), strict=True
    ):
        assert set(body) <= set(fields[kind])
        assert {f for f, required in fields[kind].items() if required} <= set(body)
    _, generate = sglang.generate_request([1, 2], {}, True, None, "run-v3")
    assert generate["lora_path"] == "run-v3" and "lora_path" in fields["GenerateReqInput"]
    assert "lora_path" not in BACKENDS["embedded"].generate_request([1], {}, True, None)[1]


class _Recorder:
    """A backends.base.Link that answers every call with success and records it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def call(self, path: str, body: Any, accept_4xx: bool = False) -> Any:
        self.calls.append((path, body))
        return {"success": True}

    async def post_once(self, path: str, body: Any) -> Any:
        return await self.call(path, body)

    def went_down(self) -> bool:
        return False


def test_the_client_names_adapters_retires_the_old_and_labels_tokens(tmp_path: Path) -> None:
    """Each adapter version loads as NAME-vK on every server and retires the one before
    the current (in-flight requests may still name the current one); requests then name
    the newest, from any sibling client of the same servers, and their tokens carry its
    version whatever the server's label."""
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rundir.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    loads: list[tuple[str, str, str | None]] = []

    class Backend(type(BACKENDS["sglang"])):
        async def load_adapter(self, link, folder, name, version, retire):  # noqa: ANN001
            loads.append((name, version, retire))
            return {"success": True, "weight_version": version}

    client = InferenceClient(["http://127.0.0.1:1"], backend="sglang", lora_name="run")
    client.backend = Backend()
    evaluator = client.sibling()  # made before any load, as evaluation during training's
    for k in (1, 2, 3):
        folder = tmp_path / f"v{k}"
        folder.mkdir()
        (folder / ADAPTER_CONFIG).write_text("{}")
        (folder / ADAPTER_WEIGHTS).write_bytes(b"")  # present: the backend reads it
        asyncio.run(client.update_weights_from_disk(str(folder), k))
    assert loads == [("run-v1", "1", None), ("run-v2", "2", None), ("run-v3", "3", "run-v1")]
    assert client.adapter == ("run-v3", "3")
    assert evaluator.adapter == ("run-v3", "3")  # it never names a retired adapter

    async def answer(path: str, body: dict) -> dict:
        assert body["lora_path"] == "run-v3"
        return {"output_ids": [4, 5], "meta_info": {"weight_version": "0"}}

    client._call_one = answer  # type: ignore[method-assign]
    out = asyncio.run(client.generate([1], {}))
    assert out["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 2}]


def test_a_corrupt_adapter_entry_never_reaches_a_server(tmp_path: Path) -> None:
    """SGLang and vLLM load the adapter themselves, so the client checks the entry's
    CRC-32s first: a flipped bit is refused with its reason, and nothing is loaded."""
    from areal_cli.inference.client import InferenceClient, WeightUpdateFailed
    from areal_cli.rundir import handoff
    from areal_cli.rundir.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    def files(folder: Path) -> list:
        return [
            handoff.write_bytes(folder, ADAPTER_CONFIG, b"{}"),
            handoff.write_bytes(folder, ADAPTER_WEIGHTS, b"\0" * 64),
        ]

    entry = handoff.write_entry(tmp_path, "v1", 1, files)
    (entry.path / ADAPTER_WEIGHTS).write_bytes(b"\0" * 63 + b"\1")
    client = InferenceClient(["http://127.0.0.1:1"], backend="vllm", lora_name="run")
    with pytest.raises(WeightUpdateFailed, match="fails its CRC-32 check"):
        asyncio.run(client.update_weights_from_disk(str(entry.path), 1))
    assert client.adapter is None

"""LoRA under real torchrun with gloo ranks: only the adapters train, layouts agree, the
published versions are PEFT adapter folders, and a resumed run continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_cli.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, our_key
from areal_cli.rundir import handoff
from tests.gloo.conftest import make_batches, torchrun, write_config
from tests.gloo.test_trainer import straight_and_resumed

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

LORA = {
    "actor.use_lora": True,
    "actor.lora_rank": 4,
    "actor.lora_alpha": 8.0,
    "actor.target_modules": ["all-linear"],
    "actor.optimizer.lr": 1e-2,
}


def _adapter(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    entry = handoff.read_entry(run_dir / "weights" / f"v{version}", verify_crc=True)
    return {our_key(k): v for k, v in load_file(str(entry.path / ADAPTER_WEIGHTS)).items()}


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "trainer-metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_lora_d1_equals_d2_and_publishes_adapters_only(tmp_path: Path, model_dir: Path) -> None:
    """1 rank x 1 micro-batch and 2 ranks x 2 micro-batches (uneven shards of every
    adapter: rank 4 over 2 ranks splits A by rows, B's rows are the layer's outputs) take
    the same two steps; each version holds only the adapters, in PEFT's layout."""
    batches = make_batches(tmp_path / "batches", 2)
    runs = {}
    for name, nproc, n_mbs in (("d1", 1, 1), ("d2", 2, 2)):
        cfg = write_config(
            tmp_path / f"{name}.yaml",
            model_dir,
            tmp_path / name,
            total_train_steps=2,
            **LORA,
            **{"actor.mb_spec.n_mbs": n_mbs},
        )
        torchrun(nproc, cfg, "--batches", str(batches))
        runs[name] = tmp_path / name / "gloo" / "t"
    for version in (1, 2):
        a, b = _adapter(runs["d1"], version), _adapter(runs["d2"], version)
        assert a.keys() == b.keys()
        # fp32 rounding of the sharded sums: 1.5e-5 on a Xeon with AMX (2026-12-05)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5
    first = _adapter(runs["d1"], 1)
    layers = {k.rsplit(".", 1)[0] for k in first}
    assert {name.rsplit(".", 1)[-1] for name in layers} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert any(float(v.abs().max()) > 0 for k, v in first.items() if k.endswith("lora_B"))
    entry = handoff.read_entry(runs["d1"] / "weights" / "v2", verify_crc=True)
    files = {f["name"] for f in entry.manifest["files"]}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= files
    assert not any(name.startswith("model") for name in files)  # no base weights travel
    config = json.loads((entry.path / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert Path(config["base_model_name_or_path"]) == model_dir.resolve()
    base = sum(v.numel() * 4 for v in load_file(str(model_dir / "model.safetensors")).values())
    adapters = sum(v.numel() * 4 for v in first.values())
    for d1, d2 in zip(_metrics(runs["d1"]), _metrics(runs["d2"]), strict=True):
        assert d1["loss"] == pytest.approx(d2["loss"], abs=1e-5)
        # the base, the adapters, and the gradients and Adam's two moments of the adapters
        # only (full fine-tuning holds 4x the parameters)
        assert d1["state_mb"] * 2**20 == pytest.approx(base + 4 * adapters, rel=0.01)


def test_lora_resume_is_exact_and_recover_holds_adapters_only(
    tmp_path: Path, model_dir: Path
) -> None:
    """4 straight steps == 2 steps, stop, resume, 2 more; the recover entry holds the
    adapters and their optimizer state, not the frozen base."""
    run_a, run_b = straight_and_resumed(tmp_path, model_dir, **LORA)
    assert [m["loss"] for m in _metrics(run_a)] == [m["loss"] for m in _metrics(run_b)]
    a, b = _adapter(run_a, 4), _adapter(run_b, 4)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(run_b / "recover" / "step-4" / "dcp")).read_metadata()
    model_keys = [k for k in stored.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys)

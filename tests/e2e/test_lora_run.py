"""A LoRA run through the real CLI (recipes/tiny_lora.yaml, the embedded server): every
version and checkpoint is a PEFT adapter folder, the recover entry holds the adapters,
--resume goes on, and convert-checkpoint --merge-lora and areal eval take its output.
(A server restarted mid-run with the current adapter: test_relaunch's "lora" layout.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from areal_cli.rundir import handoff
from areal_cli.rundir.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.conftest import free_port, run_areal
from tests.e2e.test_train import _assert_no_processes_left, _metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _areal(*args: str) -> subprocess.CompletedProcess:
    return run_areal(*args, timeout=400)


def test_a_lora_run_publishes_adapters_resumes_and_merges(tmp_path: Path) -> None:
    train = [
        "train", "recipes/tiny_lora.yaml", f"cluster.fileroot={tmp_path}",
        "logging.display=plain", f"launcher.inference_base_port={free_port()}",
        f"launcher.trainer_port={free_port()}", "rollout.batch_size=4", "rollout.group_size=2",
        "recover.freq_steps=2",
    ]  # fmt: skip
    first = _areal(*train, "total_train_steps=4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "tiny-lora" / "trial0"
    resumed = _areal(*train, "total_train_steps=6", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 7))
    for parent, prefix in (("weights", "v"), ("checkpoints", "step-")):
        entry = handoff.latest(run_dir / parent, prefix)
        files = {
            f["name"] for f in handoff.read_entry(entry.path, verify_crc=True).manifest["files"]
        }
        assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= files and "model.safetensors" not in files
    final = run_dir / "checkpoints" / "step-6"
    config = json.loads((final / ADAPTER_CONFIG).read_text())
    assert config["r"] == 16 and Path(config["base_model_name_or_path"]) == run_dir / "model"
    merged = tmp_path / "merged"
    done = _areal("convert-checkpoint", str(final), str(merged), "--merge-lora", "--verify")
    assert done.returncode == 0, done.stderr
    assert "verify: max |logit difference|" in done.stdout and (merged / "config.json").is_file()
    scored = _areal(
        "eval", "recipes/tiny_lora.yaml", f"cluster.fileroot={tmp_path}", "eval.n_samples=1",
        "eval.k=[1]", f"launcher.inference_base_port={free_port()}", "--checkpoint", str(final),
    )  # fmt: skip
    assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
    assert "step-6" in scored.stdout
    _assert_no_processes_left(run_dir)


def test_a_lora_run_sends_its_adapters_over_the_weight_group(tmp_path: Path) -> None:
    """actor.weight_update.method: distributed with LoRA: each version's entry lists the
    adapter tensors only, and the server (gloo) serves every version."""
    done = _areal(
        "train", "recipes/tiny_lora.yaml", f"cluster.fileroot={tmp_path}",
        "logging.display=plain", f"launcher.inference_base_port={free_port()}",
        f"launcher.trainer_port={free_port()}", "rollout.batch_size=4", "rollout.group_size=2",
        "total_train_steps=3", "actor.weight_update.method=distributed",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "tiny-lora" / "trial0"
    entry = handoff.read_entry(run_dir / "weights" / "v3")
    names = [m[0] for bucket in entry.manifest["meta"]["buckets"] for m in bucket]
    assert names and all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]

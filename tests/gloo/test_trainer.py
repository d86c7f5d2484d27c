"""The FSDP2 trainer under real torchrun with gloo ranks: equivalence, resume, export."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_cli.rundir import handoff
from tests.gloo.conftest import (
    make_batches,
    make_model,
    torchrun,
    torchrun_argv,
    torchrun_target,
    write_config,
)

pytestmark = [pytest.mark.gloo, pytest.mark.slow]


def _metrics(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "logs" / "trainer-metrics.jsonl").read_text().splitlines()
    ]


def _weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    entry = handoff.read_entry(run_dir / "weights" / f"v{version}", verify_crc=True)
    return _load_all(entry.path)


def _load_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder, however it is sharded."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_one_rank_equals_two_ranks_two_microbatches(tmp_path: Path, model_dir: Path) -> None:
    """Same global batch: 1 rank x 1 micro-batch vs 2 ranks x 2 micro-batches."""
    batches = make_batches(tmp_path / "batches", 2)
    runs = {}
    for name, nproc, n_mbs in (("single", 1, 1), ("split", 2, 2)):
        fileroot = tmp_path / name
        cfg = write_config(
            tmp_path / f"{name}.yaml",
            model_dir,
            fileroot,
            total_train_steps=2,
            **{"actor.mb_spec.n_mbs": n_mbs},
        )
        torchrun(nproc, cfg, "--batches", str(batches))
        runs[name] = fileroot / "gloo" / "t"
    single, split = (_metrics(runs[k]) for k in ("single", "split"))
    for a, b in zip(single, split, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for version in (1, 2):
        assert _max_diff(_weights(runs["single"], version), _weights(runs["split"], version)) < 1e-5


def _two_steps_at(
    tmp_path: Path, model_dir: Path, batches: Path, keys: dict, layouts: tuple
) -> dict[str, Path]:
    """Two steps on `batches` with recipe `keys` at each (name, ranks, micro-batches) of
    `layouts`; the run directories by name."""
    runs = {}
    for name, nproc, n_mbs in layouts:
        fileroot = tmp_path / name
        cfg = write_config(
            tmp_path / f"{name}.yaml", model_dir, fileroot, total_train_steps=2,
            **{**keys, "actor.mb_spec.n_mbs": n_mbs},
        )  # fmt: skip
        torchrun(nproc, cfg, "--batches", str(batches))
        runs[name] = fileroot / "gloo" / "t"
    return runs


def test_sapo_and_m2po_take_the_same_step_on_one_and_two_ranks(
    tmp_path: Path, model_dir: Path
) -> None:
    """SAPO's loss with M2PO's filter: the filter's bound is taken over the minibatch's
    tokens on every rank (one all-gather), so 1 rank x 1 micro-batch and 2 ranks x 2
    micro-batches (uneven shards) drop the same tokens and take the same step."""
    batches = make_batches(tmp_path / "batches", 2)
    keys = {"actor.use_sapo_loss": True, "actor.use_decoupled_loss": False}
    keys["actor.m2_threshold"] = 1.0  # random behaviour logprobs: m2 averages several
    runs = _two_steps_at(tmp_path, model_dir, batches, keys, (("d1", 1, 1), ("d2", 2, 2)))
    one, two = _metrics(runs["d1"]), _metrics(runs["d2"])
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert 0 < a["m2_drop_frac"] == pytest.approx(b["m2_drop_frac"], abs=1e-9)
    assert _max_diff(_weights(runs["d1"], 2), _weights(runs["d2"], 2)) < 1e-5


def test_distillation_rejection_and_loglinear_take_the_same_step_on_one_two_and_three_ranks(
    tmp_path: Path, model_dir: Path
) -> None:
    """On-policy distillation (a frozen teacher sharded like the actor, joint with the RL
    loss), sequence-level rejection sampling and the loglinear proximal approximation
    over two minibatches: 1 rank x 1 micro-batch, 2 ranks x 2 and 3 ranks x 2 (uneven
    shards, empty micro-batches) take the same steps."""
    batches = make_batches(tmp_path / "batches", 2)
    teacher = make_model(tmp_path / "teacher", seed=7)
    keys = {
        "teacher.path": str(teacher), "teacher.rl_loss_weight": 1.0,
        "teacher.distill_loss_weight": 0.5, "actor.ppo_n_minibatches": 2,
        "actor.prox_logp_method": "loglinear", "actor.rejection_sampling.level": "sequence",
        "actor.rejection_sampling.upper": 1.5,
    }  # fmt: skip
    layouts = (("d1", 1, 1), ("d2", 2, 2), ("d3", 3, 2))
    runs = _two_steps_at(tmp_path, model_dir, batches, keys, layouts)
    one = _metrics(runs["d1"])
    assert all(r["distill_kl"] != 0 for r in one)
    for name in ("d2", "d3"):
        for a, b in zip(one, _metrics(runs[name]), strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), name
            assert a["distill_kl"] == pytest.approx(b["distill_kl"], abs=1e-5), name
            assert a["rejected_frac"] == pytest.approx(b["rejected_frac"], abs=1e-9), name
        # Four Adam updates (2 steps x 2 minibatches) turn the 3-rank all-reduces' other
        # rounding of near-zero gradients into weight differences of 2.5e-5 (AMD EPYC)
        bound = 1e-5 if name == "d2" else 1e-4
        assert _max_diff(_weights(runs["d1"], 2), _weights(runs[name], 2)) < bound, name


def straight_and_resumed(tmp_path: Path, model_dir: Path, **keys: object) -> tuple[Path, Path]:
    """Two 2-rank runs on the same 4 batches (recover entries every step, with `keys`):
    straight through, and 2 steps, stop, --resume; their run directories."""
    batches = make_batches(tmp_path / "batches", 4)
    extra = {"recover.freq_steps": 1, "recover.keep_last": 2, **keys}
    straight = write_config(tmp_path / "a.yaml", model_dir, tmp_path / "a", **extra)
    torchrun(2, straight, "--batches", str(batches))
    resumed = write_config(tmp_path / "b.yaml", model_dir, tmp_path / "b", **extra)
    torchrun(2, resumed, "--batches", str(batches), "--steps", "2")
    torchrun(2, resumed, "--batches", str(batches), "--resume")
    return tmp_path / "a" / "gloo" / "t", tmp_path / "b" / "gloo" / "t"


def test_resume_is_exact(tmp_path: Path, model_dir: Path) -> None:
    """4 straight steps == 2 steps, stop, resume, 2 more, bit for bit. (A checkpoint that
    resumes in another layout, where DCP reshards, is test_tensor_parallel's: d2 into t2,
    c2 and t2c2.)"""
    run_a, run_b = straight_and_resumed(tmp_path, model_dir)
    losses_a = [m["loss"] for m in _metrics(run_a)]
    losses_b = [m["loss"] for m in _metrics(run_b)]
    assert losses_a == losses_b  # bit-identical
    assert _max_diff(_weights(run_a, 4), _weights(run_b, 4)) == 0.0
    assert [e.path.name for e in handoff.list_entries(run_b / "recover", "step-")] == [
        "step-3",
        "step-4",
    ]


def test_export_loads_in_hf_and_matches_trainer_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # An odd vocabulary: the embedding's 97 rows split 49/48, so the ranks' byte ranges in
    # the shared safetensors file are uneven.
    model_dir = make_model(tmp_path / "model", vocab=97)
    batches = make_batches(tmp_path / "batches", 1)
    cfg = write_config(tmp_path / "cfg.yaml", model_dir, tmp_path / "runs")
    out = tmp_path / "out"
    out.mkdir()
    probe = str(Path(__file__).with_name("export_probe.py"))
    torchrun_target(2, probe, str(cfg), str(batches), str(out))
    exported = handoff.read_entry(out / "v1", verify_crc=True)
    assert [f["name"] for f in exported.manifest["files"]][0] == "model.safetensors"
    hf = AutoModelForCausalLM.from_pretrained(exported.path, dtype=torch.float32).eval()
    saved = torch.load(out / "trainer_logits.pt")
    with torch.no_grad():
        logits = hf(input_ids=saved["probe"]).logits
    assert float((logits - saved["logits"]).abs().max()) < 1e-5
    # and the export differs from the initial weights (the step really trained)
    assert (
        _max_diff(
            _load_all(exported.path),
            load_file(str(model_dir / "model.safetensors")),
        )
        > 1e-4
    )


def test_export_writes_every_parameter_layout_exactly(tmp_path: Path) -> None:
    """Uneven Shard(0) rows are written in place by each rank; Replicate, Shard(1) and
    plain tensors go through rank 0. The file must hold exactly the full weights."""
    model_dir = make_model(tmp_path / "model", vocab=97)
    out = tmp_path / "out"
    out.mkdir()
    probe = str(Path(__file__).with_name("placements_probe.py"))
    torchrun_target(2, probe, str(model_dir), str(out))
    expected = torch.load(out / "expected.pt")
    for version in (0, 1):
        exported = handoff.read_entry(out / f"v{version}", verify_crc=True)
        assert _max_diff(_load_all(exported.path), expected) == 0.0


def test_trainer_waits_for_rollouts_in_the_run_dir(tmp_path: Path, model_dir: Path) -> None:
    """Without --batches the trainer polls RUN/rollouts/step-K and ignores unfinished writes."""
    cfg = write_config(tmp_path / "cfg.yaml", model_dir, tmp_path / "runs", total_train_steps=1)
    run_dir = tmp_path / "runs" / "gloo" / "t"
    (run_dir / "rollouts" / ".tmp-step-1-dead").mkdir(parents=True)  # a crashed writer's leftovers
    argv = torchrun_argv(1, "-m", "areal_cli.trainer.main", "--config", str(cfg))
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    try:
        line = proc.stdout.readline()  # blocks until the trainer reports that it waits
        assert "waiting for" in line and "rollouts/step-1" in line, line
        time.sleep(1.5)
        assert proc.poll() is None  # still waiting
        make_batches(run_dir / "rollouts", 1)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    record = _metrics(run_dir)[0]
    assert record["wait_s"] > 1.0 and record["weight_version"] == 1
    assert handoff.latest(run_dir / "weights", "v").version == 1


def test_tied_embeddings_stay_tied_when_sharded(tmp_path: Path) -> None:
    from tests.gloo.conftest import make_model

    model = make_model(tmp_path / "tied", tied=True)
    result = torchrun_target(2, str(Path(__file__).with_name("tied_probe.py")), str(model))
    assert "TIED-OK" in result.stdout


def test_compiled_layers_take_the_same_step(tmp_path: Path, model_dir: Path) -> None:
    """actor.compile (each decoder layer through torch.compile, the packed attention
    eager between its two graphs) under FSDP2 on 2 ranks, 2 micro-batches of differing
    lengths (shapes turn dynamic), against one eager rank: the same losses and weights."""
    batches = make_batches(tmp_path / "batches", 2)
    eager = _two_steps_at(tmp_path, model_dir, batches, {}, (("eager", 1, 1),))["eager"]
    cfg = write_config(
        tmp_path / "compiled.yaml", model_dir, tmp_path / "compiled", total_train_steps=2,
        **{"actor.compile": True, "actor.mb_spec.n_mbs": 2},
    )  # fmt: skip
    ran = torchrun(2, cfg, "--batches", str(batches))
    assert "actor.compile: 2 decoder layers go through torch.compile" in ran.stderr
    compiled = tmp_path / "compiled" / "gloo" / "t"
    for a, b in zip(_metrics(eager), _metrics(compiled), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert _max_diff(_weights(eager, 2), _weights(compiled, 2)) < 1e-5

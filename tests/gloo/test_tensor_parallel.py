"""Tensor and context parallelism beside FSDP2 (gloo): every layout against one rank.

Layouts t2, c2, d2t2, d2c2 and t2c2 (4 ranks on 2 cores). The vocabulary (97) does not
split evenly; the batch is skewed so the dp ranks plan different micro-batch counts, and
its packed micro-batches (40-token and 6-token sequences) are cut by context parallelism
inside sequences. The step uses decoupled PPO plus KL (a reference model sharded the same
way), once with token_mean and once with seq_mean (sequences split across cp ranks). SGD at lr 1 without clipping makes the exported weights w0 - grad,
so comparing them compares every parameter's gradient, and tests the export of
tensor-parallel shards (each rank writes its own block) at the same time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gloo.conftest import layout_args, make_model, torchrun_target, write_config
from tests.gloo.test_collectives import _record, _run, _skewed_batch, _weights

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

LAYOUTS = {
    "t2": ("embedded:d1+fsdp:d1t2", 2),
    "c2": ("embedded:d1+fsdp:d1c2", 2),
    "d2t2": ("embedded:d1+fsdp:d2t2", 4),
    "d2c2": ("embedded:d1+fsdp:d2c2", 4),
    "t2c2": ("embedded:d1+fsdp:d1t2c2", 4),
}
CASES = [(*layout, "token_mean") for layout in LAYOUTS.values()]
CASES += [(*LAYOUTS["c2"], "seq_mean"), (*LAYOUTS["t2c2"], "seq_mean")]
CASE_IDS = list(LAYOUTS) + ["c2-seq_mean", "t2c2-seq_mean"]


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads of each kind: t2c2 splits them into 1 per rank
    return make_model(tmp_path_factory.mktemp("tp") / "model", vocab=97, heads=4, kv_heads=4)


@pytest.mark.parametrize(("allocation", "nproc", "agg"), CASES, ids=CASE_IDS)
def test_step_matches_one_rank(
    tmp_path: Path, tp_model: Path, allocation: str, nproc: int, agg: str
) -> None:
    batches = _skewed_batch(tmp_path / "batches", 4, 4, vocab=97)
    extra = {"actor.loss_agg_mode": agg}
    single = _run(tmp_path, "single", 1, tp_model, batches, **extra)
    layout = tuple(layout_args(allocation))
    split = _run(
        tmp_path, "split", nproc, tp_model, batches, layout, allocation_mode=allocation, **extra
    )
    a, b = _record(single), _record(split)
    for key in ("loss", "kl", "entropy", "imp_weight_mean", "clip_frac"):
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["tokens"] == b["tokens"]  # tp replicas are not counted twice
    wa, wb = _weights(single), _weights(split)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert float((wa[key] - wb[key]).abs().max()) < 1e-5, key


@pytest.mark.parametrize(("allocation", "nproc"), LAYOUTS.values(), ids=list(LAYOUTS))
def test_logprobs_match_one_rank(
    tmp_path: Path, tp_model: Path, allocation: str, nproc: int
) -> None:
    batches = _skewed_batch(tmp_path / "batches", 3, 4, vocab=97)
    probe = str(Path(__file__).with_name("logprob_probe.py"))
    found = {}
    for name, n, alloc in (("single", 1, "embedded:d1+fsdp:d1"), ("split", nproc, allocation)):
        out = tmp_path / name
        out.mkdir()
        cfg = write_config(
            tmp_path / f"{name}.yaml", tp_model, tmp_path / "runs", allocation_mode=alloc
        )
        torchrun_target(n, probe, str(cfg), str(batches), str(out))
        found[name] = torch.load(out / "logprobs.pt")
    for key in ("logp", "entropy"):
        diff = float((found["single"][key] - found["split"][key]).abs().max())
        assert diff < 1e-5, (key, diff)
    # --dry-run's table of who holds which block says what the trainer really does.
    from areal_cli.config.allocation import parse_allocation
    from areal_cli.launch.layout import ModelDims, sample_layer

    train = parse_allocation(allocation).train
    dims = ModelDims.from_config(json.loads((tp_model / "config.json").read_text()))
    shown = sample_layer(
        dims, nproc // (train.context_parallel_size * train.tensor_parallel_size),
        train.context_parallel_size, train.tensor_parallel_size,
    )  # fmt: skip
    for rank, blocks in enumerate(found["split"]["blocks"]):
        for name, ((r0, c0), (rows, cols)) in blocks.items():
            line = f"  rank {rank}: rows {r0}:{r0 + rows}, columns {c0}:{c0 + cols}"
            where = shown.index(next(x for x in shown if name in x))
            assert line in shown[where : where + nproc + 1], (name, line, shown)


RESUMED = ["t2", "c2", "t2c2"]


@pytest.mark.parametrize(("allocation", "nproc"), [LAYOUTS[k] for k in RESUMED], ids=RESUMED)
def test_a_data_parallel_checkpoint_resumes_in_another_layout(
    tmp_path: Path, tp_model: Path, allocation: str, nproc: int
) -> None:
    """d2 for 2 steps with recover checkpoints, then step 3 under d2 and, from the same
    checkpoint, under the new layout: DCP reshards, and the step's loss is the same."""
    from tests.gloo.conftest import make_batches, torchrun
    from tests.gloo.test_trainer import _metrics

    batches = make_batches(tmp_path / "batches", 3, vocab=97)
    extra = {"recover.freq_steps": 1, "recover.keep_last": 3, "total_train_steps": 3}
    runs = {}
    for name in ("d2", "resumed"):
        cfg = write_config(tmp_path / f"{name}.yaml", tp_model, tmp_path / name, **extra)
        torchrun(2, cfg, "--batches", str(batches), "--steps", "2")
        runs[name] = (cfg, tmp_path / name / "gloo" / "t")
    torchrun(2, runs["d2"][0], "--batches", str(batches), "--resume")
    moved = write_config(
        tmp_path / "moved.yaml", tp_model, tmp_path / "resumed", allocation_mode=allocation, **extra
    )
    torchrun(nproc, moved, "--batches", str(batches), "--resume", *layout_args(allocation))
    straight, resumed = _metrics(runs["d2"][1]), _metrics(runs["resumed"][1])
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert resumed[2]["loss"] == pytest.approx(straight[2]["loss"], abs=1e-5)
    assert resumed[2]["grad_norm"] == pytest.approx(straight[2]["grad_norm"], rel=1e-5)
    # The new layout's recover checkpoint converts to an HF folder equal to the weights the
    # same step published, and that folder loads in transformers.
    from transformers import AutoModelForCausalLM

    from tests.conftest import run_areal
    from tests.gloo.test_trainer import _load_all, _weights

    hf = tmp_path / "hf"
    done = run_areal(
        "convert-checkpoint", str(runs["resumed"][1] / "recover" / "step-3"), str(hf),
        "--model-config", str(tp_model),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    converted, published = _load_all(hf), _weights(runs["resumed"][1], 3)
    assert converted.keys() == published.keys()
    assert all(torch.equal(converted[k], published[k]) for k in converted)
    AutoModelForCausalLM.from_pretrained(hf)

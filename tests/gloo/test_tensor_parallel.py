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
CASES += [(*LAYOUTS["t2c2"], "seq_mean")]  # seq_mean under TP and CP at once
CASE_IDS = list(LAYOUTS) + ["t2c2-seq_mean"]
# The logprob probe also checks --dry-run's block table; each dimension alone and both
# together (the step cases above cover d2t2 and d2c2, whose loss needs the same logprobs).
PROBED = ["t2", "c2", "t2c2"]


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads of each kind: t2c2 splits them into 1 per rank
    return make_model(tmp_path_factory.mktemp("tp") / "model", vocab=97, heads=4, kv_heads=4)


class OneRank:
    """What one rank computes, run once per module and shared by every layout's case (the
    model and the batches are fixed, so it is the same reference each time)."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        self.steps: dict[str, Path] = {}
        self.logprobs: dict | None = None
        self.step_batches = _skewed_batch(root / "step-batches", 4, 4, vocab=97)
        self.probe_batches = _skewed_batch(root / "probe-batches", 3, 4, vocab=97)

    def step(self, agg: str) -> Path:
        """The one-rank run of one step with loss_agg_mode `agg`."""
        if agg not in self.steps:
            extra = {"actor.loss_agg_mode": agg}
            self.steps[agg] = _run(
                self.root, f"single-{agg}", 1, self.model, self.step_batches, **extra
            )
        return self.steps[agg]

    def logprob(self) -> dict:
        """The one-rank logprobs and entropy of the probe batch."""
        if self.logprobs is None:
            self.logprobs = _probe(
                self.root, "single", 1, "embedded:d1+fsdp:d1", self.model, self.probe_batches
            )
        return self.logprobs


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory, tp_model: Path) -> OneRank:
    return OneRank(tmp_path_factory.mktemp("one-rank"), tp_model)


def _probe(root: Path, name: str, n: int, allocation: str, model: Path, batches: Path) -> dict:
    """The logprob probe's output (logp, entropy, each rank's blocks) under `allocation`."""
    out = root / name
    out.mkdir()
    cfg = write_config(root / f"{name}.yaml", model, root / "runs", allocation_mode=allocation)
    torchrun_target(
        n, str(Path(__file__).with_name("logprob_probe.py")), str(cfg), str(batches), str(out)
    )
    return torch.load(out / "logprobs.pt")


@pytest.mark.parametrize(("allocation", "nproc", "agg"), CASES, ids=CASE_IDS)
def test_step_matches_one_rank(
    tmp_path: Path, tp_model: Path, one_rank: OneRank, allocation: str, nproc: int, agg: str
) -> None:
    single = one_rank.step(agg)
    layout = tuple(layout_args(allocation))
    extra = {"actor.loss_agg_mode": agg, "allocation_mode": allocation}
    split = _run(tmp_path, "split", nproc, tp_model, one_rank.step_batches, layout, **extra)
    a, b = _record(single), _record(split)
    for key in ("loss", "kl", "entropy", "imp_weight_mean", "clip_frac"):
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["tokens"] == b["tokens"]  # tp replicas are not counted twice
    wa, wb = _weights(single), _weights(split)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert float((wa[key] - wb[key]).abs().max()) < 1e-5, key


@pytest.mark.parametrize(("allocation", "nproc"), [LAYOUTS[k] for k in PROBED], ids=PROBED)
def test_logprobs_match_one_rank(
    tmp_path: Path, tp_model: Path, one_rank: OneRank, allocation: str, nproc: int
) -> None:
    found = {
        "single": one_rank.logprob(),
        "split": _probe(tmp_path, "split", nproc, allocation, tp_model, one_rank.probe_batches),
    }
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
RESUME_EXTRA = {"recover.freq_steps": 1, "recover.keep_last": 3, "total_train_steps": 3}


@pytest.fixture(scope="module")
def d2_runs(tmp_path_factory: pytest.TempPathFactory, tp_model: Path) -> dict[str, Path]:
    """Once per module: d2 for 2 steps with recover checkpoints ("prefix", kept as it is),
    and a copy of it that went on with step 3 under d2 ("straight")."""
    import shutil

    from tests.gloo.conftest import make_batches, torchrun

    root = tmp_path_factory.mktemp("d2")
    batches = make_batches(root / "batches", 3, vocab=97)
    cfg = write_config(root / "prefix.yaml", tp_model, root / "prefix", **RESUME_EXTRA)
    torchrun(2, cfg, "--batches", str(batches), "--steps", "2")
    shutil.copytree(root / "prefix", root / "straight")
    cfg = write_config(root / "straight.yaml", tp_model, root / "straight", **RESUME_EXTRA)
    torchrun(2, cfg, "--batches", str(batches), "--resume")
    return {"batches": batches, "prefix": root / "prefix", "straight": root / "straight"}


@pytest.mark.parametrize(("allocation", "nproc"), [LAYOUTS[k] for k in RESUMED], ids=RESUMED)
def test_a_data_parallel_checkpoint_resumes_in_another_layout(
    tmp_path: Path, tp_model: Path, d2_runs: dict[str, Path], allocation: str, nproc: int
) -> None:
    """d2 for 2 steps with recover checkpoints, then step 3 under d2 and, from the same
    checkpoint, under the new layout: DCP reshards, and the step's loss is the same."""
    import shutil

    from tests.gloo.conftest import torchrun
    from tests.gloo.test_trainer import _metrics

    shutil.copytree(d2_runs["prefix"], tmp_path / "resumed")
    moved = write_config(
        tmp_path / "moved.yaml", tp_model, tmp_path / "resumed", allocation_mode=allocation,
        **RESUME_EXTRA,
    )  # fmt: skip
    batches = d2_runs["batches"]
    torchrun(nproc, moved, "--batches", str(batches), "--resume", *layout_args(allocation))
    run_dir = tmp_path / "resumed" / "gloo" / "t"
    straight, resumed = _metrics(d2_runs["straight"] / "gloo" / "t"), _metrics(run_dir)
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
        "convert-checkpoint", str(run_dir / "recover" / "step-3"), str(hf),
        "--model-config", str(tp_model),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    converted, published = _load_all(hf), _weights(run_dir, 3)
    assert converted.keys() == published.keys()
    assert all(torch.equal(converted[k], published[k]) for k in converted)
    AutoModelForCausalLM.from_pretrained(hf)

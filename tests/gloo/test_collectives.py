"""Every rank issues the same collectives whatever its shard holds (gloo, 2 and 3 ranks).

The batches are skewed on purpose: the first ranks get sequences longer than
`max_tokens_per_mb` (one micro-batch each), the last ones get a few short sequences that
pack into one micro-batch, or fewer sequences than the others have micro-batches. With
SGD at lr 1 and no clipping, the exported weights are w0 - grad, so comparing them with a
1-rank run on the whole batch compares the gradients themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_cli.rundir import handoff
from areal_cli.rundir.batch import RolloutBatch, write_batch
from tests.gloo.conftest import torchrun, write_config

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

LONG, SHORT, CAP = 40, 6, 32


def _skewed_batch(directory: Path, n_long: int, n_short: int, vocab: int = 96) -> Path:
    """step-1: `n_long` sequences of LONG tokens, then `n_short` of SHORT tokens, with given
    advantages (group_size 1), behaviour logprobs and a loss mask on the last half."""
    gen = torch.Generator().manual_seed(7)
    seqs = []
    for n in [LONG] * n_long + [SHORT] * n_short:
        mask = torch.cat([torch.zeros(n // 2), torch.ones(n - n // 2)]).to(torch.int8)
        seqs.append(
            {
                "input_ids": torch.randint(0, vocab, (n,), generator=gen),
                "loss_mask": mask,
                "logprobs": (-torch.rand(n, generator=gen) * 4 - 0.5) * mask,
                "versions": torch.where(mask.bool(), 0, -1).to(torch.int32),
            }
        )
    n_seqs = n_long + n_short
    batch = RolloutBatch.from_sequences(seqs, [0.0] * n_seqs, group_size=1)
    batch.advantages = torch.randn(n_seqs, generator=gen)
    write_batch(directory, 1, batch)
    return directory


def _run(
    tmp_path: Path,
    name: str,
    nproc: int,
    model: Path,
    batches: Path,
    layout: tuple[str, ...] = (),
    **extra,
) -> Path:
    """One step on `batches` with `nproc` ranks (`layout`: the trainer's --dp/--cp/--tp)."""
    fileroot = tmp_path / name
    cfg = write_config(
        tmp_path / f"{name}.yaml",
        model,
        fileroot,
        total_train_steps=1,
        **{
            "actor.optimizer.type": "sgd",
            "actor.optimizer.lr": 1.0,
            "actor.optimizer.gradient_clipping": 0.0,
            "actor.mb_spec.max_tokens_per_mb": CAP,
            "actor.kl_ctl": 0.1,  # a reference pass too
            "trainer.collective_timeout_s": 60,
            **extra,
        },
    )
    torchrun(nproc, cfg, "--batches", str(batches), *layout, timeout=240)
    return fileroot / "gloo" / "t"


def _record(run_dir: Path) -> dict:
    lines = (run_dir / "logs" / "trainer-metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    entry = handoff.read_entry(run_dir / "weights" / "v1", verify_crc=True)
    return load_file(str(entry.path / "model.safetensors"))


@pytest.mark.parametrize(
    ("nproc", "n_long", "n_short", "minibatches"),
    [
        (2, 4, 4, 1),  # rank 0: 4 micro-batches of one long sequence; rank 1: 1 of four short
        (3, 3, 4, 2),  # minibatches of 4 and 3 sequences, each split unevenly over 3 ranks
    ],
)
def test_skewed_shards_match_one_rank(
    tmp_path: Path, model_dir: Path, nproc: int, n_long: int, n_short: int, minibatches: int
) -> None:
    batches = _skewed_batch(tmp_path / "batches", n_long, n_short)
    extra = {"actor.ppo_n_minibatches": minibatches}
    single = _run(tmp_path, "single", 1, model_dir, batches, **extra)
    split = _run(tmp_path, "split", nproc, model_dir, batches, **extra)
    a, b = _record(single), _record(split)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["kl"] == pytest.approx(b["kl"], abs=1e-5)
    assert a["tokens"] == b["tokens"] == n_long * LONG + n_short * SHORT
    wa, wb = _weights(single), _weights(split)
    assert wa.keys() == wb.keys()
    initial = load_file(str(model_dir / "model.safetensors"))
    for key in wa:
        # w1 = w0 - grad, so this compares the gradients (and the update happened).
        assert float((wa[key] - wb[key]).abs().max()) < 1e-5, key
    assert max(float((wa[k] - initial[k]).abs().max()) for k in wa) > 1e-3


def test_a_rank_left_waiting_in_a_collective_fails_naming_its_phase(
    tmp_path: Path, model_dir: Path
) -> None:
    """Without a controller (trainer run directly), trainer.collective_timeout_s still
    turns a stopped peer into an error instead of a wait."""
    import subprocess
    import time

    from tests.gloo.conftest import make_batches, torchrun_argv

    batches = make_batches(tmp_path / "batches", 2)
    cfg = write_config(
        tmp_path / "cfg.yaml", model_dir, tmp_path / "runs", total_train_steps=2,
        **{"trainer.collective_timeout_s": 5},
    )  # fmt: skip
    argv = torchrun_argv(2, "-m", "areal_cli.trainer.main", "--config", str(cfg))
    env = {
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "AREAL_FAULT_HANG": "trainer-1:step 1: train mb 1/",
    }
    start = time.monotonic()
    result = subprocess.run(
        [*argv, "--batches", str(batches)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "rank 0 failed in phase 'step 1: train mb 1/1'" in result.stderr, result.stderr[-3000:]

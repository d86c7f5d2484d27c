"""--dry-run's trainer layout: the mesh, the sample layer's blocks, the memory estimate.
(tests/gloo/test_tensor_parallel.py checks the blocks against the real trainer.)"""

from __future__ import annotations

import pytest

from areal_cli.config.schema import BUILTIN_ARCHITECTURES
from areal_cli.launch.layout import ModelDims, memory_per_rank, rank_grid
from tests.conftest import run_areal

SMALL = ModelDims.from_config(BUILTIN_ARCHITECTURES["small"])


def test_ranks_are_laid_out_with_tp_innermost() -> None:
    assert rank_grid(2, 2, 2) == [
        "dp 0: cp 0 tp [0 1]  cp 1 tp [2 3]",
        "dp 1: cp 0 tp [4 5]  cp 1 tp [6 7]",
    ]


def test_each_dim_divides_what_it_should() -> None:
    one = memory_per_rank(SMALL, 1, 1, 1, tokens=4096)
    d2 = memory_per_rank(SMALL, 2, 1, 1, tokens=4096)
    t2 = memory_per_rank(SMALL, 1, 1, 2, tokens=4096)
    c2 = memory_per_rank(SMALL, 1, 2, 1, tokens=4096)
    for term in ("parameters", "gradients", "optimizer"):
        assert d2[term] == pytest.approx(one[term] / 2)
        assert one[term] / 2 <= t2[term] < one[term] * 0.51  # norms stay whole on tp ranks
    assert d2["activations"] == one["activations"]  # a micro-batch is as long on every rank
    assert c2["activations"] < one["activations"] * 0.51  # c splits the tokens
    assert c2["attention scores"] == pytest.approx(one["attention scores"] / 2)
    assert t2["gathered block"] == pytest.approx(one["gathered block"] / 2)
    short = memory_per_rank(SMALL, 1, 1, 1, tokens=4096, seq_len=512)
    assert short["attention scores"] == pytest.approx(one["attention scores"] / 8)  # per sequence


def test_flash_attention_on_gpus_keeps_no_scores() -> None:
    """On GPUs in bf16 the trainer's varlen FlashAttention keeps a logsumexp per query and
    head, not the scores: the estimate drops by the longest sequence's length."""
    scores = memory_per_rank(SMALL, 1, 1, 1, tokens=4096, compute_dtype="bfloat16")
    flash = memory_per_rank(SMALL, 1, 1, 1, tokens=4096, compute_dtype="bfloat16", gpu=True)
    fp32 = memory_per_rank(SMALL, 1, 1, 1, tokens=4096, gpu=True)
    assert "attention scores" not in flash and "attention scores" in fp32
    assert flash["attention (flash)"] == pytest.approx(scores["attention scores"] / 4096)
    assert flash["total"] < scores["total"]


def test_dry_run_prints_the_trainer_layout() -> None:
    result = run_areal(
        "train", "recipes/tiny_cpu.yaml", "--dry-run",
        "allocation_mode=embedded:d1+fsdp:d2t2", "cluster.n_cpus=5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh dp 2 x cp 1 x tp 2 = 4 ranks" in out
    assert "layers.0.self_attn.o_proj.weight [128, 128]" in out
    assert "rank 1: rows 0:64, columns 64:128" in out  # tp 1 holds the right half
    assert "optimizer" in out and "(one rank alone:" in out


def test_the_logits_term_is_split_by_t_and_c_and_follows_the_compute_dtype() -> None:
    """The logits are kept in the compute dtype (and their gradient), plus one chunk of
    float32 temporaries of the size the trainer uses (trainer.losses.CHUNK_ELEMENTS)."""
    from areal_cli.launch.layout import LOGITS_CHUNK_ELEMENTS
    from areal_cli.trainer.losses import CHUNK_ELEMENTS

    assert LOGITS_CHUNK_ELEMENTS == CHUNK_ELEMENTS
    one = memory_per_rank(SMALL, 1, 1, 1, tokens=4096)
    t2 = memory_per_rank(SMALL, 1, 1, 2, tokens=4096)
    c2 = memory_per_rank(SMALL, 1, 2, 1, tokens=4096)
    bf16 = memory_per_rank(SMALL, 1, 1, 1, tokens=4096, compute_dtype="bfloat16")
    chunk = min(4096 * SMALL.vocab, CHUNK_ELEMENTS) * 12
    assert one["logits"] == pytest.approx(4096 * SMALL.vocab * 2 * 4 + chunk)
    assert bf16["logits"] == pytest.approx(4096 * SMALL.vocab * 2 * 2 + chunk)
    assert t2["logits"] < one["logits"] * 0.51 and c2["logits"] < one["logits"] * 0.51

"""The running batch's slot cache (areal_cli/inference/kv_cache.py): buffers grow by
doubling only in the dimension that is short, keeping what they hold."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from areal_cli.inference.kv_cache import RunningBatch


def _shapes(batch: RunningBatch) -> tuple[int, int]:
    buf = batch.layers[0].key_buf
    return buf.shape[0], buf.shape[2]


def test_rows_and_columns_grow_apart_and_keep_their_contents() -> None:
    batch = RunningBatch(SimpleNamespace(num_hidden_layers=2), max_rows=100)
    like = [torch.zeros(1, 3, 1, 8) for _ in range(2)]
    batch.reserve(1, 40, like)
    assert _shapes(batch) == (4, 64)
    batch.layers[1].value_buf[2, 1, 39, 5] = 7.0
    seen = []
    for rows in range(2, 101):  # a batch that fills up one row at a time
        batch.reserve(rows, 40)
        seen.append(_shapes(batch))
    # the rows double (capped at max_rows); the columns stay (they used to double as well)
    assert sorted(set(seen)) == [(4, 64), (8, 64), (16, 64), (32, 64), (64, 64), (100, 64)]
    batch.reserve(100, 65)
    assert _shapes(batch) == (100, 128)
    batch.reserve(50, 300)
    assert _shapes(batch) == (100, 300)
    assert batch.layers[1].value_buf[2, 1, 39, 5] == 7.0
    assert batch.layers[1].value_buf.sum() == 7.0  # the rest is zeros, not leftovers
    assert batch.nbytes == 2 * 2 * 100 * 3 * 300 * 8 * 4


def test_the_generation_moves_whenever_the_buffers_are_replaced() -> None:
    """Decode graphs compare it to know that the buffers they recorded are gone (a new
    buffer can come back at an old one's address, with another layout)."""
    batch = RunningBatch(SimpleNamespace(num_hidden_layers=2), max_rows=8)
    like = [torch.zeros(1, 3, 1, 8) for _ in range(2)]
    batch.reserve(2, 10, like)
    first = batch.generation
    batch.reserve(2, 64)  # fits: the same buffers
    assert batch.generation == first
    batch.reserve(2, 65)  # more columns: new buffers
    assert batch.generation == first + 1
    batch.clear()
    assert batch.generation == first + 2
    batch.reserve(2, 65, like)
    assert batch.generation == first + 3

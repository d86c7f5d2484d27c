"""The allocation grammar."""

from __future__ import annotations

import pytest

from areal_cli.config.allocation import AllocationError, parse_allocation


def test_parses_both_sides() -> None:
    mode = parse_allocation("sglang:d4t2+fsdp:d8")
    assert mode.inference_backend == "sglang" and mode.train_backend == "fsdp"
    assert (mode.inference.data_parallel_size, mode.inference.tensor_parallel_size) == (4, 2)
    assert mode.inference.world_size == 8 and mode.inference.per_replica_size == 2
    assert mode.train.world_size == 8 and mode.n_servers == 4


def test_order_and_whitespace_do_not_matter() -> None:
    assert parse_allocation("fsdp:d2 + embedded:d1") == parse_allocation("embedded:d1+fsdp:d2")


def test_inference_only_and_defaults() -> None:
    mode = parse_allocation("sglang:t2")
    assert (
        mode.train is None
        and mode.inference.data_parallel_size == 1
        and mode.inference.world_size == 2
    )


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "empty"),
        ("fsdp", "no ':dims' part"),
        ("fsdp:", "cannot parse"),
        ("fsdp:2", "cannot parse"),
        ("fsdp:d0", "must be at least 1"),
        ("fsdp:d2d2", "given twice"),
        ("fsdp:d2x2", "unknown dimension 'x'"),
        ("megatron:d2", "unknown backend 'megatron'"),
        ("sglang:d1+embedded:d1", "two inference components"),
        ("fsdp:d1+fsdp:d2", "two train components"),
        ("fsdp:d2p2", "pipeline"),
        ("embedded:t2", "one whole model per process"),
        ("sglang:d1c2", "context parallelism"),
    ],
)
def test_rejects_with_reason(text: str, fragment: str) -> None:
    with pytest.raises(AllocationError) as info:
        parse_allocation(text)
    assert fragment in info.value.message and info.value.fix


def test_fsdp_takes_tensor_parallel_ranks() -> None:
    mode = parse_allocation("embedded:d1+fsdp:d2t2")
    assert (mode.train.data_parallel_size, mode.train.tensor_parallel_size) == (2, 2)
    assert mode.train.world_size == 4

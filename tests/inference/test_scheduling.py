"""Admission order (longest-first vs FCFS) and the split of a prefill group into passes."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_cli.inference.api import GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine, split_by_length


def _seqs(lengths: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(kv_len=n - 1) for n in lengths]


def test_split_keeps_every_sequence_once_and_sorts_by_length() -> None:
    seqs = _seqs([60, 8, 9, 61, 10, 59, 30])
    parts = split_by_length(seqs, pass_cost=16)
    flat = [s for part in parts for s in part]
    assert sorted(map(id, flat)) == sorted(map(id, seqs))
    lengths = [s.kv_len for s in flat]
    assert lengths == sorted(lengths)
    assert len(parts) > 1  # short and long contexts are not padded together


def test_split_keeps_similar_lengths_together() -> None:
    assert split_by_length([], pass_cost=16) == []
    assert len(split_by_length(_seqs([20, 21, 22, 20]), pass_cost=16)) == 1
    # a pass costs more than the padding it would save: one pass
    assert len(split_by_length(_seqs([8, 60]), pass_cost=1000)) == 1


def _finish_order(engine: InferenceEngine, lengths: list[int]) -> list[int]:
    engine.pause("in_place")
    done: list[int] = []
    futures = []
    for n in lengths:
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        future = engine.submit(GenerateRequest(input_ids=[11, 12, 13], sampling_params=params))
        future.add_done_callback(lambda f: done.append(len(f.result().output_ids)))
        futures.append(future)
    engine.continue_generation()
    for future in futures:
        future.result(60)
    # A future's waiters wake before its done callbacks run (concurrent.futures), so the
    # last callback may still be on its way when result() returns: wait for it.
    deadline = time.monotonic() + 10
    while len(done) < len(lengths) and time.monotonic() < deadline:
        time.sleep(0.01)
    return done


@pytest.mark.parametrize(
    ("policy", "wait_s", "expected"),
    [
        ("lof", 60.0, [9, 5, 2]),
        ("fcfs", 60.0, [2, 9, 5]),
        ("lof", 0.0, [2, 9, 5]),  # waited too long: arrival order wins
    ],
)
def test_admission_order(
    tiny_model_dir: Path, policy: str, wait_s: float, expected: list[int]
) -> None:
    engine = InferenceEngine(
        tiny_model_dir,
        device="cpu",
        max_running_requests=1,
        schedule_policy=policy,
        max_queue_wait_s=wait_s,
    )
    try:
        assert _finish_order(engine, [2, 9, 5]) == expected
    finally:
        engine.shutdown()


def test_unknown_policy_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        InferenceEngine(tiny_model_dir, device="cpu", schedule_policy="random")  # type: ignore[arg-type]

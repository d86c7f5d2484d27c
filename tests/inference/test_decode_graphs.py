"""Static decode steps (inference.graphs): the path a GPU captures as CUDA graphs.

On a CPU the same static step runs uncaptured (`decode_graphs="eager"`): padded to a row
bucket, attending over a width bucket, with the write offsets and mask computed from the
static inputs. These tests hold it to the plain step and to transformers: greedy equal to
`model.generate`, logprobs equal to teacher forcing, seeded requests the same alone and in
any batch, across width buckets and across a memory release.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from areal_cli.inference.engine import InferenceEngine
from areal_cli.inference.graphs import resolve_mode, row_buckets, width_bucket
from tests.inference.test_engine import hf_greedy, request, teacher_forced

EXACT = 1e-5  # fp32


@pytest.fixture(scope="module")
def static_engine(tiny_model_dir: Path) -> Iterator[InferenceEngine]:
    eng = InferenceEngine(
        tiny_model_dir, device="cpu", max_running_requests=64, decode_graphs="eager"
    )
    yield eng
    eng.shutdown()


def mixed_prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (count,), generator=gen).tolist()
    return [torch.randint(3, 380, (n,), generator=gen).tolist() for n in lengths]


def test_buckets_and_modes() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert row_buckets(128)[-3:] == [96, 112, 128]
    assert [width_bucket(n, 4096) for n in (1, 64, 65, 129, 1000)] == [64, 64, 128, 256, 1024]
    assert width_bucket(65, 100) == 100  # never past the allocated columns
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("auto", cpu, True) == "off"
    assert resolve_mode("auto", cuda, True) == "cuda"
    assert resolve_mode("auto", cuda, False) == "off"  # a transformers model's forward
    assert resolve_mode("eager", cpu, True) == "eager"
    with pytest.raises(ValueError, match="need a CUDA device"):
        resolve_mode("cuda", cpu, True)
    with pytest.raises(ValueError, match="Llama-family"):
        resolve_mode("eager", cpu, False)
    with pytest.raises(ValueError, match="one of auto, cuda, eager, off"):
        resolve_mode("always", cpu, True)


def test_cuda_graphs_on_a_cpu_are_refused_at_start(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        InferenceEngine(tiny_model_dir, device="cpu", decode_graphs="cuda")


def test_greedy_of_32_mixed_requests_equals_generate_and_teacher_forcing(
    static_engine: InferenceEngine, hf_model
) -> None:
    prompts = mixed_prompts(32)
    futures = [
        static_engine.submit(request(p, temperature=0.0, max_new_tokens=20, ignore_eos=True))
        for p in prompts
    ]
    for prompt, future in zip(prompts, futures, strict=True):
        out = future.result(timeout=120)
        assert out.output_ids == hf_greedy(hf_model, prompt, 20)
        expected = teacher_forced(hf_model, prompt, out.output_ids, 1.0)
        assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=EXACT)
    assert static_engine.decode_graphs_info.startswith("static steps run eagerly")


def test_widths_crossing_buckets_and_columns_growing(
    static_engine: InferenceEngine, hf_model
) -> None:
    prompt = mixed_prompts(1, seed=3)[0][:50] + list(range(200, 250))  # 50..100 tokens
    req = request(prompt, temperature=0.0, max_new_tokens=180, ignore_eos=True)
    out = static_engine.generate_sync(req, timeout=120)  # widths 128, 256, 512 (the cap)
    assert out.output_ids == hf_greedy(hf_model, prompt, 180)
    expected = teacher_forced(hf_model, prompt, out.output_ids, 1.0)
    assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=EXACT)


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch_of_64(
    static_engine: InferenceEngine, tiny_model_dir: Path
) -> None:
    def seeded() -> object:
        return request([7, 8, 9], temperature=1.0, max_new_tokens=24, sampling_seed=11,
                       ignore_eos=True)  # fmt: skip

    alone = static_engine.generate_sync(seeded(), timeout=60)
    others = [
        request(p, temperature=1.0, max_new_tokens=30, ignore_eos=True)
        for p in mixed_prompts(63, seed=5)
    ]
    futures = [static_engine.submit(r) for r in others[:40]]
    inside = static_engine.submit(seeded())
    futures += [static_engine.submit(r) for r in others[40:]]
    for future in futures:
        future.result(timeout=300)
    assert inside.result(timeout=60).output_ids == alone.output_ids
    plain = InferenceEngine(tiny_model_dir, device="cpu", decode_graphs="off")
    try:  # and the plain step draws them too
        assert plain.generate_sync(seeded(), timeout=60).output_ids == alone.output_ids
        assert plain.decode_graphs_info == "plain steps"
    finally:
        plain.shutdown()


def test_release_and_resume_keep_the_static_step_right(tiny_model_dir: Path, hf_model) -> None:
    eng = InferenceEngine(tiny_model_dir, device="cpu", decode_graphs="eager")
    try:
        prompt = [40, 41, 42, 43]
        before = eng.generate_sync(request(prompt, temperature=0.0, max_new_tokens=12))
        assert eng._batch.nbytes > 0  # held while idle, for the graphs
        eng.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
        assert eng._batch.nbytes == 0
        eng.resume_memory_occupation(None)
        after = eng.generate_sync(request(prompt, temperature=0.0, max_new_tokens=12))
        assert after.output_ids == before.output_ids == hf_greedy(hf_model, prompt, 12)
    finally:
        eng.shutdown()


def test_a_graph_that_cannot_be_captured_turns_graphs_off_and_the_step_goes_on(
    tiny_model_dir: Path, hf_model
) -> None:
    """An error path: a capture that fails (here: CUDA asked for on a CPU, forced past the
    check at start) is said once and the engine decodes plain steps from then on."""
    eng = InferenceEngine(tiny_model_dir, device="cpu", decode_graphs="eager")
    try:
        eng._graphs.mode = "cuda"
        prompt = [5, 6, 7]
        out = eng.generate_sync(request(prompt, temperature=0.0, max_new_tokens=10))
        assert out.output_ids == hf_greedy(hf_model, prompt, 10)
        assert eng.decode_graphs_info.startswith("plain steps (graphs turned off: ")
        assert not eng._batch.hold_buffers
    finally:
        eng.shutdown()

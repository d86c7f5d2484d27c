"""The continuous-batching engine against plain Hugging Face forward passes.

Acceptance criteria: logprobs equal a teacher-forced forward pass, greedy equals
`model.generate`, hot weight reload (and refusal of broken folders), per-request isolation
under concurrency, abort/pause semantics and weight-version spans.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from areal_cli.inference.api import GenerateOutput, GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine

TOL = 1e-4
PROMPTS = [[5], [300, 12, 99], [40, 41, 42, 43, 44, 45, 46, 47], list(range(100, 131))]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[InferenceEngine]:
    """A shared fp32 CPU engine; tests that change its state restore it."""
    eng = InferenceEngine(tiny_model_dir, device="cpu", max_running_requests=32)
    yield eng
    eng.shutdown()


@pytest.fixture
def fresh_engine(tiny_model_dir: Path) -> Iterator[InferenceEngine]:
    """A private engine for tests that swap weights or pause."""
    eng = InferenceEngine(tiny_model_dir, device="cpu", weight_version="v0")
    yield eng
    eng.shutdown()


def request(ids: list[int], rid: str | None = None, **params: object) -> GenerateRequest:
    return GenerateRequest(
        input_ids=ids, sampling_params=SamplingParams(**params), return_logprob=True, rid=rid
    )


def greedy(
    engine: InferenceEngine, ids: list[int], n: int = 16, ignore_eos: bool = False
) -> GenerateOutput:
    req = request(ids, temperature=0.0, max_new_tokens=n, ignore_eos=ignore_eos)
    return engine.generate_sync(req, timeout=60)


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()


def teacher_forced(
    model: torch.nn.Module, prompt: list[int], out: list[int], temp: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each output token given everything before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / temp, dim=-1)
    return logprobs.gather(1, torch.tensor(out)[:, None])[:, 0]


def wait_for_tokens(engine: InferenceEngine, rid: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats().progress.get(rid, 0) < n:
        assert time.monotonic() < deadline, f"{rid} did not reach {n} tokens"
        time.sleep(0.002)


# --------------------------------------------------------------------------- 1. correctness


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_hf_generate(engine: InferenceEngine, hf_model, prompt: list[int]) -> None:
    out = greedy(engine, prompt, 24)
    assert out.output_ids == hf_greedy(hf_model, prompt, 24)
    expected = teacher_forced(hf_model, prompt, out.output_ids, 1.0)
    assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=TOL)
    assert out.finish_reason in ({"type": "length", "length": 24}, {"type": "stop", "matched": 2})


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.6, "top_p": 0.9},
        {"temperature": 1.4, "top_k": 20},
        {"temperature": 0.8, "top_k": 50, "top_p": 0.7},
    ],
)
def test_sampled_logprobs_equal_teacher_forcing(engine: InferenceEngine, hf_model, params) -> None:
    prompt = PROMPTS[2]
    out = engine.generate_sync(
        request(prompt, max_new_tokens=32, ignore_eos=True, sampling_seed=7, **params)
    )
    assert len(out.output_ids) == 32
    expected = teacher_forced(hf_model, prompt, out.output_ids, params["temperature"])
    assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=TOL)
    # Every sampled token lies inside the top-k / top-p support of its distribution.
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1]
    probs = torch.softmax(logits / params["temperature"], dim=-1)
    for row, token in zip(probs, out.output_ids, strict=True):
        rank = int((row > row[token]).sum())
        assert rank < params.get("top_k", 10**9)
        assert float(row[row > row[token]].sum()) < params.get("top_p", 1.0) + 1e-6


def test_seed_reproducible_and_varied(engine: InferenceEngine) -> None:
    def run(seed: int) -> list[int]:
        req = request(
            PROMPTS[1], temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=seed
        )
        return engine.generate_sync(req).output_ids

    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_stop_tokens_eos_and_length(engine: InferenceEngine) -> None:
    ref = greedy(engine, PROMPTS[3], 12).output_ids
    stop = ref[5]
    out = engine.generate_sync(
        request(PROMPTS[3], temperature=0, max_new_tokens=12, stop_token_ids=[stop])
    )
    cut = ref.index(stop) + 1
    assert out.output_ids == ref[:cut]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    # EOS stops unless ignore_eos; stop_token_ids apply either way.
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({stop})
    try:
        eos = engine.generate_sync(request(PROMPTS[3], temperature=0, max_new_tokens=12))
        ignored = engine.generate_sync(
            request(PROMPTS[3], temperature=0, max_new_tokens=12, ignore_eos=True)
        )
    finally:
        engine.eos_token_ids = saved
    assert eos.output_ids == ref[:cut] and eos.finish_reason["type"] == "stop"
    assert ignored.output_ids == ref and ignored.finish_reason == {"type": "length", "length": 12}


def test_response_dict_and_text_input(engine: InferenceEngine) -> None:
    req = GenerateRequest.from_dict(
        {
            "text": "What is 3+4?",
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "skip_special_tokens": True},
            "return_logprob": True,
            "rid": "text-req",
        }
    )
    body = engine.generate_sync(req).to_dict()
    meta = body["meta_info"]
    assert meta["id"] == "text-req" and meta["completion_tokens"] == 5
    assert meta["prompt_tokens"] == len(engine.tokenizer("What is 3+4?")["input_ids"])
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert body["text"] == engine.tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    json.dumps(body)


@pytest.mark.parametrize(
    "body, match",
    [
        ({"input_ids": []}, "empty"),
        ({"input_ids": [10**6]}, "out of range"),
        ({"input_ids": [1], "text": "x"}, "exactly one"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
        ({"input_ids": [[1, 2]]}, "flat list"),
    ],
)
def test_invalid_requests(engine: InferenceEngine, body: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.submit(GenerateRequest.from_dict(body))


def test_async_generate(engine: InferenceEngine) -> None:
    async def main() -> list[GenerateOutput]:
        reqs = [request(p, temperature=0, max_new_tokens=6) for p in PROMPTS]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    outs = asyncio.run(main())
    assert [o.output_ids for o in outs] == [greedy(engine, p, 6).output_ids for p in PROMPTS]


def test_model_error_fails_requests_not_the_engine(fresh_engine: InferenceEngine) -> None:
    eng = fresh_engine
    real_forward = eng.model.forward
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_forward(*args, **kwargs)

    eng.model.forward = flaky
    try:
        doomed = eng.submit(request([4, 5], temperature=0, max_new_tokens=10, ignore_eos=True))
        with pytest.raises(RuntimeError, match="boom"):
            doomed.result(timeout=60)
    finally:
        eng.model.forward = real_forward
    assert len(greedy(eng, [4, 5], 5).output_ids) == 5
    assert eng.is_alive()


def test_bfloat16_runs(tiny_model_dir: Path) -> None:
    with InferenceEngine(tiny_model_dir, device="cpu", dtype="bfloat16") as eng:
        out = eng.generate_sync(
            request(PROMPTS[2], temperature=0.7, max_new_tokens=8, sampling_seed=1)
        )
    assert len(out.output_ids) == 8
    assert all(lp <= 0 for lp in out.output_logprobs)


# --------------------------------------------------------------------------- 2. weights


def test_update_weights_matches_hf_on_new_weights(
    fresh_engine: InferenceEngine, tiny_model_dir_alt: Path, hf_model, hf_model_alt
) -> None:
    prompt = PROMPTS[2]
    assert greedy(fresh_engine, prompt, 16).output_ids == hf_greedy(hf_model, prompt, 16)
    ok, message, _ = fresh_engine.update_weights_from_disk(tiny_model_dir_alt, "v1")
    assert ok, message
    assert fresh_engine.weight_version == "v1"
    out = greedy(fresh_engine, prompt, 16)
    assert out.output_ids == hf_greedy(hf_model_alt, prompt, 16)
    assert out.output_ids != hf_greedy(hf_model, prompt, 16)
    assert out.weight_version == "v1"
    assert out.weight_versions == [{"version": "v1", "start": 0, "end": 16}]
    expected = teacher_forced(hf_model_alt, prompt, out.output_ids, 1.0)
    assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=TOL)


def test_alternating_updates_and_a_refused_one_serve_the_right_weights(
    fresh_engine: InferenceEngine,
    tiny_model_dir: Path,
    tiny_model_dir_alt: Path,
    hf_model,
    hf_model_alt,
    tmp_path: Path,
) -> None:
    """On the CPU the engine serves from the buffer it read into and reads the next update
    into the one it served from before: every switch must serve exactly the new weights,
    and a refused file of the same size (read into the spare buffer) must change nothing."""
    prompt = PROMPTS[2]
    expected = {
        d: hf_greedy(m, prompt, 12)
        for d, m in ((tiny_model_dir, hf_model), (tiny_model_dir_alt, hf_model_alt))
    }
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir_alt, broken)
    with open(broken / "model.safetensors", "r+b") as f:  # same size, header no longer JSON
        f.seek(8)
        f.write(b"\x00" * 8)
    served = tiny_model_dir
    for i, folder in enumerate(
        [tiny_model_dir_alt, tiny_model_dir, broken, tiny_model_dir_alt, tiny_model_dir]
    ):
        ok, message, _ = fresh_engine.update_weights_from_disk(folder, f"v{i + 1}")
        assert ok == (folder != broken), message
        served = served if folder == broken else folder
        assert greedy(fresh_engine, prompt, 12).output_ids == expected[served], (i, folder)


def test_entries_renamed_into_a_watched_folder_are_read_ahead(
    fresh_engine: InferenceEngine,
    tiny_model_dir: Path,
    tiny_model_dir_alt: Path,
    hf_model,
    hf_model_alt,
    tmp_path: Path,
) -> None:
    """The server reads each new weights/vN while the controller is still on its way; the
    update then only swaps. An entry replaced after it was read ahead is read again."""
    from areal_cli.rundir import handoff

    weights = tmp_path / "weights"

    def publish(name: str, source: Path) -> Path:
        files = sorted(p for p in source.iterdir() if p.is_file())
        number = int(name[1:])
        write = lambda tmp: [handoff.link_or_copy(f, tmp) for f in files]  # noqa: E731
        return handoff.write_entry(weights, name, number, write).path

    def read_ahead_of(path: Path) -> bool:
        deadline = time.monotonic() + 20
        while fresh_engine.read_ahead_folder != path and time.monotonic() < deadline:
            time.sleep(0.01)
        return fresh_engine.read_ahead_folder == path

    prompt = PROMPTS[2]
    publish("v0", tiny_model_dir)  # there before the watch: not read
    fresh_engine.watch_for_weights(weights, poll_s=0.05)
    v1 = publish("v1", tiny_model_dir_alt)
    assert read_ahead_of(v1)
    ok, message, _ = fresh_engine.update_weights_from_disk(v1, "1")
    assert ok and "(read ahead)" in message, message
    assert fresh_engine.read_ahead_folder is None
    assert greedy(fresh_engine, prompt, 12).output_ids == hf_greedy(hf_model_alt, prompt, 12)

    v2 = publish("v2", tiny_model_dir)
    assert read_ahead_of(v2)
    publish("v2", tiny_model_dir_alt)  # replaced (other files) before its update came
    ok, message, _ = fresh_engine.update_weights_from_disk(v2, "2")
    assert ok and "(read now)" in message, message
    assert greedy(fresh_engine, prompt, 12).output_ids == hf_greedy(hf_model_alt, prompt, 12)


def _missing_file(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _truncated(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _wrong_shape(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 3)
    save_file(tensors, folder / "model.safetensors")


def _missing_tensor(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")


def _missing_shard(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, folder / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + (i >= 10)}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    "damage, match",
    [
        (_missing_file, "no \\*.safetensors"),
        (_truncated, "cannot read"),
        (_wrong_shape, "up_proj.weight: checkpoint \\[7, 3\\]"),
        (_missing_tensor, "missing tensor.*lm_head.weight"),
        (_missing_shard, "missing shard.*00002"),
    ],
)
def test_broken_folder_is_refused(
    fresh_engine: InferenceEngine, tiny_model_dir_alt: Path, tmp_path: Path, damage, match: str
) -> None:
    before = greedy(fresh_engine, PROMPTS[1], 12)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir_alt, broken)
    damage(broken)
    ok, message, _ = fresh_engine.update_weights_from_disk(broken, "bad")
    assert not ok
    assert str(broken) in message and "still serving 'v0'" in message
    assert re.search(match, message), message
    after = greedy(fresh_engine, PROMPTS[1], 12)
    assert fresh_engine.weight_version == "v0"
    assert after.output_ids == before.output_ids
    assert after.output_logprobs == before.output_logprobs
    assert after.weight_version == "v0"


def test_nonexistent_folder_is_refused(fresh_engine: InferenceEngine, tmp_path: Path) -> None:
    ok, message, _ = fresh_engine.update_weights_from_disk(tmp_path / "nope", "bad")
    assert not ok and "does not exist" in message


# --------------------------------------------------------------------------- 3. isolation


def test_concurrent_requests_match_solo_runs(engine: InferenceEngine) -> None:
    rng = random.Random(0)
    reqs = []
    for i in range(32):
        prompt = [rng.randrange(7, engine.vocab_size) for _ in range(rng.randint(1, 48))]
        params = {
            "temperature": 0.0 if i % 4 == 0 else rng.choice([0.5, 1.0, 1.3]),
            "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([-1, 30]),
            "max_new_tokens": rng.randint(1, 40),
            "ignore_eos": rng.random() < 0.5,
            "sampling_seed": 1000 + i,
        }
        reqs.append(request(prompt, rid=f"iso-{i}", **params))
    solo = [engine.generate_sync(r, timeout=60) for r in reqs]
    futures = [engine.submit(r) for r in reqs]
    together = [f.result(timeout=120) for f in futures]
    for alone, mixed in zip(solo, together, strict=True):
        assert mixed.output_ids == alone.output_ids, alone.rid
        assert mixed.finish_reason == alone.finish_reason
        diff = torch.tensor(mixed.output_logprobs) - torch.tensor(alone.output_logprobs)
        assert diff.abs().max() < TOL, alone.rid


def test_short_request_not_held_back_by_long_one(engine: InferenceEngine) -> None:
    long = engine.submit(
        request([7, 8, 9], rid="long", temperature=0, max_new_tokens=600, ignore_eos=True)
    )
    wait_for_tokens(engine, "long", 2)
    short = engine.submit(request([10, 11], temperature=0, max_new_tokens=3, ignore_eos=True))
    assert len(short.result(timeout=60).output_ids) == 3
    assert not long.done()
    assert engine.abort("long")
    assert long.result(timeout=60).finish_reason["type"] == "abort"


# --------------------------------------------------------------------------- 4. abort, pause, spans


def test_abort_returns_partial_output(engine: InferenceEngine, hf_model) -> None:
    prompt = PROMPTS[1]
    future = engine.submit(
        request(prompt, rid="to-abort", temperature=0, max_new_tokens=800, ignore_eos=True)
    )
    wait_for_tokens(engine, "to-abort", 3)
    assert engine.abort("to-abort")
    out = future.result(timeout=60)
    assert out.finish_reason["type"] == "abort" and out.finish_reason["message"]
    assert 3 <= len(out.output_ids) < 800
    assert len(out.output_logprobs) == len(out.output_ids)
    assert out.output_ids == hf_greedy(hf_model, prompt, len(out.output_ids))
    assert not engine.abort("to-abort")
    assert not engine.abort("never-existed")


def test_pause_abort_mode_then_continue(fresh_engine: InferenceEngine) -> None:
    eng = fresh_engine
    running = [
        eng.submit(
            request([20 + i], rid=f"p{i}", temperature=0, max_new_tokens=800, ignore_eos=True)
        )
        for i in range(3)
    ]
    wait_for_tokens(eng, "p2", 1)
    assert eng.pause("abort") == 3
    assert all(f.result(timeout=60).finish_reason["type"] == "abort" for f in running)
    later = eng.submit(request([30], temperature=0, max_new_tokens=4))
    time.sleep(0.2)
    assert not later.done() and eng.stats().num_waiting == 1
    eng.continue_generation()
    assert len(later.result(timeout=60).output_ids) == 4


def test_pause_in_place_keeps_state(fresh_engine: InferenceEngine) -> None:
    eng = fresh_engine
    ref = greedy(eng, PROMPTS[2], 300, ignore_eos=True).output_ids
    future = eng.submit(
        request(PROMPTS[2], rid="keep", temperature=0, max_new_tokens=300, ignore_eos=True)
    )
    wait_for_tokens(eng, "keep", 2)
    eng.pause("in_place")
    made = eng.stats().progress["keep"]
    time.sleep(0.2)
    assert eng.stats().progress["keep"] == made and not future.done()
    eng.continue_generation()
    assert future.result(timeout=60).output_ids == ref


def test_pause_retract_recomputes_and_matches(fresh_engine: InferenceEngine) -> None:
    eng = fresh_engine
    ref = greedy(eng, PROMPTS[3], 300, ignore_eos=True)
    future = eng.submit(
        request(PROMPTS[3], rid="retract", temperature=0, max_new_tokens=300, ignore_eos=True)
    )
    wait_for_tokens(eng, "retract", 2)
    assert eng.pause("retract") == 1
    assert eng.stats().num_waiting == 1
    eng.continue_generation()
    out = future.result(timeout=60)
    assert out.output_ids == ref.output_ids
    assert torch.allclose(
        torch.tensor(out.output_logprobs), torch.tensor(ref.output_logprobs), atol=TOL
    )


def test_mid_request_weight_swap_gives_two_spans(
    fresh_engine: InferenceEngine, tiny_model_dir_alt: Path
) -> None:
    eng = fresh_engine
    future = eng.submit(
        request([5, 6], rid="swap", temperature=1.0, max_new_tokens=600, ignore_eos=True)
    )
    wait_for_tokens(eng, "swap", 3)
    eng.pause("in_place")
    split = eng.stats().progress["swap"]
    ok, message, _ = eng.update_weights_from_disk(tiny_model_dir_alt, "v1")
    assert ok, message
    eng.continue_generation()
    out = future.result(timeout=60)
    assert len(out.output_ids) == 600
    assert out.weight_versions == [
        {"version": "v0", "start": 0, "end": split},
        {"version": "v1", "start": split, "end": 600},
    ]
    assert out.weight_version == "v1"


def test_update_weight_version_and_abort_all(fresh_engine: InferenceEngine) -> None:
    eng = fresh_engine
    futures = [
        eng.submit(request([9, i], temperature=0, max_new_tokens=800, ignore_eos=True, rid=f"a{i}"))
        for i in range(2)
    ]
    wait_for_tokens(eng, "a1", 1)
    assert eng.abort_all() == 2
    assert {f.result(timeout=60).finish_reason["type"] for f in futures} == {"abort"}
    eng.update_weight_version("v7")
    assert greedy(eng, [3], 2).weight_version == "v7"


def test_released_memory_holds_requests_until_an_update_refills_the_weights(
    fresh_engine: InferenceEngine, tiny_model_dir_alt: Path, hf_model_alt
) -> None:
    """Colocated (inference.memory): released CPU weights are dropped; a request waits;
    after resume the next update reads them again, and the request runs on them."""
    from areal_cli.inference.memory import MemoryBusy

    eng = fresh_engine
    prompt = PROMPTS[2]
    running = eng.submit(request([20], rid="r", temperature=0, max_new_tokens=800, ignore_eos=True))
    wait_for_tokens(eng, "r", 1)
    with pytest.raises(MemoryBusy, match="1 request"):
        eng.release_memory_occupation()
    assert eng.pause("abort") == 1 and running.result(timeout=60).finish_reason["type"] == "abort"
    eng.continue_generation()
    eng.release_memory_occupation(["weights", "kv_cache"])
    assert eng.released == {"weights", "kv_cache"}
    assert all(p.numel() == 0 for p in eng.model.parameters())  # the memory went back
    waiting = eng.submit(request(prompt, temperature=0, max_new_tokens=12))
    time.sleep(0.2)
    assert not waiting.done() and eng.stats().num_waiting == 1
    eng.resume_memory_occupation(["weights"])
    with pytest.raises(MemoryBusy, match="released"):
        eng.weights_crc32()
    ok, message, _ = eng.update_weights_from_disk(tiny_model_dir_alt, "v1")
    assert ok, message
    assert not waiting.done()  # the KV cache is still released
    eng.resume_memory_occupation(["kv_cache"])
    assert waiting.result(timeout=60).output_ids == hf_greedy(hf_model_alt, prompt, 12)
    with pytest.raises(ValueError, match="unknown memory tag"):
        eng.release_memory_occupation(["activations"])
    eng.release_memory_occupation(["cuda_graph"])  # SGLang's third tag: graphs, none held
    eng.resume_memory_occupation(["cuda_graph"])


def test_resumed_without_an_update_the_engine_reads_its_last_folder_again(
    fresh_engine: InferenceEngine,
) -> None:
    eng = fresh_engine
    before = eng.generate_sync(
        request(PROMPTS[3], temperature=1.0, sampling_seed=5, max_new_tokens=10)
    )
    crc = eng.weights_crc32()
    eng.release_memory_occupation()
    eng.resume_memory_occupation()
    after = eng.generate_sync(
        request(PROMPTS[3], temperature=1.0, sampling_seed=5, max_new_tokens=10)
    )
    assert after.output_ids == before.output_ids and after.output_logprobs == before.output_logprobs
    assert eng.weights_crc32() == crc and eng.released == frozenset()


def test_a_model_outside_our_decoder_runs_on_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A folder our own decoder does not build (here rotary scaling 'dynamic') is served
    through transformers' model with the same slot cache: greedy equals generate, and the
    logprobs equal a transformers forward."""
    folder = tmp_path / "dynamic-rope"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with InferenceEngine(folder, device="cpu") as eng:
        assert not eng._model.own and type(eng.model).__name__ == "LlamaForCausalLM"
        for prompt in PROMPTS[:3]:
            out = greedy(eng, prompt, 12)
            assert out.output_ids == hf_greedy(hf, prompt, 12)
            expected = teacher_forced(hf, prompt, out.output_ids, 1.0)
            assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=TOL)

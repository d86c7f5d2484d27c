"""Usage: python scripts/gpu_bench.py [--cpu] [--part engine,trainer] [--reps 2] [--skip-generate] [--decode-graphs auto] [--trainer-attention auto] [--trainer-compile]

The embedded engine's and the trainer's speed on one GPU (issues 44 and 45), each against
the loop a user has without SGLang, vLLM or a framework, on the same device in the same
run: transformers' `model.generate` for the engine (~3 minutes on an H200), an afternoon's
plain PyTorch training loop for the trainer (~3 minutes). Needs only this repository,
torch and transformers (no network: the model is built here with random weights).

  model       SmolLM2-360M's shape (Llama: hidden 960, 32 layers, 15 heads, 5 KV heads,
              intermediate 2560, vocabulary 49152, tied embeddings), random weights, bf16.
              Its tokenizer is SmolLM2's when `make smollm2` has put it in
              $AREAL_CACHE_DIR, else a word-level one of the same size built here (the
              prompts are random ids either way; the tokenizer only decodes the replies).
  batch       128 requests of 128 prompt tokens and 256 new ones, ignore_eos,
              temperature 1, logprobs on, max_running_requests 128: one warm-up, then
              --reps timed repetitions. The engine's tokens/s against model.generate's
              (do_sample, top_k off) on the same batch, and their ratio (goal >= 5x).
  batch 1     one request of 64 new tokens against one of 2: milliseconds per decode
              step, against the bandwidth bound (the weights' bytes over the device's own
              copy rate, measured here; goal <= 2 ms on an H200).
  resumed     the same batch once more after /release_memory_occupation and /resume (a
              colocated run's cycle, which drops the decode graphs): tokens/s, how many
              graphs were captured again, and the ratio to the best run.
  memory      the device's peak allocated memory over the engine's runs (on the CPU:
              the process's peak resident memory).
  profile     one torch.profiler trace of --profile-steps decode steps at batch 128:
              kernels and CUDA graphs launched and host<->device copies per step.
  graphs      --decode-graphs: how decode steps run (areal_cli.inference.graphs). auto:
              CUDA graphs on the GPU, and under --cpu the same static steps uncaptured
              ("eager", the path's CPU rehearsal); off: plain steps, the baseline.
  exactness   on a smaller Llama in float32 (peaked random weights, so greedy picks are
              not decided by rounding): logprobs against a transformers forward (bound
              1e-5), greedy outputs against model.generate for 32 requests of mixed
              lengths, and a seeded request alone against inside a batch of 64.
  trainer     (--part trainer) areal_cli.trainer.main under torchrun, one rank, FSDP2 with
              bf16 compute and fp32 reduction, micro-batches of <= 16384 tokens, on 4
              fixed GRPO batches of 128 sequences: 128 prompt tokens + 384 (equal
              lengths), then + 16..1024 drawn uniformly (mixed), against the plain loop
              (fp32 master weights, bf16 autocast, SDPA, fused AdamW, micro-batches padded
              to their longest sequence, the same token-level policy-gradient loss):
              tokens/s (real tokens), seconds per step (median of steps 2-4), MFU
              (6 x parameters x tokens over the bf16 matmul rate measured in the same
              run) and peak GPU memory of each (the trainer's own record,
              peak_device_mb), and their ratios (goals: >= 1.0x and MFU >= 30% at equal
              lengths, >= 1.5x at mixed, less memory). --trainer-attention picks the
              packed attention's kernel (areal_cli.trainer.attention; auto: varlen
              FlashAttention on the GPU once its probe passes, else SDPA per padded
              width, "buckets"); the trainer rows name the one that ran.
              --trainer-compile trains with actor.compile (each decoder layer through
              torch.compile; the steps timed are 2.., after the compile).

--cpu runs every part on the CPU with a tiny model and a small batch (CI runs it:
tests/e2e/test_gpu_bench.py), so the script cannot rot. It prints one table; the exit
code is 1 when an exactness check fails (speed goals are reported, not enforced).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Setup:
    """The model shape and the batch of one mode (GPU or --cpu)."""

    shape: dict
    dtype: str
    requests: int
    prompt_tokens: int
    new_tokens: int
    single_new_tokens: int
    exact_shape: dict


SMOLLM2_360M = dict(
    hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
    num_key_value_heads=5, vocab_size=49152, tie_word_embeddings=True,
    max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
)  # fmt: skip
EXACT = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False,
    max_position_embeddings=1024, initializer_range=0.1,
)  # fmt: skip
TINY = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True,
    max_position_embeddings=512,
)  # fmt: skip
GPU = Setup(SMOLLM2_360M, "bfloat16", 128, 128, 256, 64, EXACT)
CPU = Setup(TINY, "float32", 16, 32, 32, 32, {**EXACT, "num_hidden_layers": 2})


class Rows(list):
    """A part's table rows, each also printed the moment it is measured, so that a run cut
    short (the device's time limit) still shows what it measured."""

    started = time.perf_counter()

    def __init__(self, *rows: tuple) -> None:
        super().__init__()
        for row in rows:
            self.append(row)

    def append(self, row: tuple) -> None:
        took = time.perf_counter() - Rows.started
        print(f"[gpu_bench {took:4.0f}s] " + " | ".join(map(str, row)), flush=True)
        super().append(row)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly `vocab_size` entries ("w0" ... ), built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", unk_token="w0")


def build_model(folder: Path, shape: dict, seed: int, dtype: str = "float32") -> tuple[Path, str]:
    """A Llama folder of `shape` with random weights (seed), stored in `dtype`, and a
    tokenizer of its vocabulary; returns it and the tokenizer's origin."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_cli.models.builtin import cache_dir

    config = LlamaConfig(**{"head_dim": shape["hidden_size"] // shape["num_attention_heads"],
                            "bos_token_id": 1, "eos_token_id": 1, **shape})  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    model.save_pretrained(folder, safe_serialization=True)
    smol = cache_dir() / "models" / "smollm2-135m-instruct"
    if shape["vocab_size"] == 49152 and (smol / "tokenizer.json").exists():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (smol / name).exists():
                shutil.copy(smol / name, folder / name)
        return folder, f"SmolLM2's ({smol})"
    word_tokenizer(shape["vocab_size"]).save_pretrained(folder)
    return folder, f"word-level, {shape['vocab_size']} entries (built here)"


def parameter_count(folder: Path) -> int:
    """The parameters stored in the folder's safetensors files (a tied head once)."""
    from safetensors import safe_open

    count = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                count += math.prod(f.get_slice(name).get_shape())
    return count


def describe(shape: dict, folder: Path) -> str:
    """'Llama hidden 960, 32 layers, 15/5 heads, ..., 361.8M parameters'."""
    return (
        f"Llama hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, "
        f"vocabulary {shape['vocab_size']}, {parameter_count(folder) / 1e6:.1f}M parameters"
    )


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def engine_run(engine, batch: list[list[int]], new_tokens: int, seed: int = 0) -> tuple[int, float]:
    """All of `batch` submitted at once; (tokens generated, seconds)."""
    from areal_cli.inference.api import GenerateRequest, SamplingParams

    start = time.perf_counter()
    futures = [
        engine.submit(
            GenerateRequest(
                input_ids=ids,
                sampling_params=SamplingParams(
                    temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                    sampling_seed=seed + i,
                ),
                return_logprob=True,
            )
        )
        for i, ids in enumerate(batch)
    ]  # fmt: skip
    outs = [f.result(600) for f in futures]
    return sum(len(o.output_ids) for o in outs), time.perf_counter() - start


def load_hf(folder: Path, dtype: str, device: str):
    """The folder's model in transformers, with no end-of-sequence token: like the
    engine's ignore_eos, every request runs its full length and EOS can be picked
    (min_new_tokens would instead forbid it, a different distribution)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    hf.generation_config.eos_token_id = None
    return hf.to(device).eval()


def generate_run(model, batch: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """transformers' sampling loop over the same batch (equal prompt lengths: no padding)."""
    import torch

    ids = torch.tensor(batch, device=model.device)
    sync(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
            top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=0,
        )  # fmt: skip
    sync(model.device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0], time.perf_counter() - start


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_rate(device: str) -> float:
    """Bytes per second the device copies (read + write), over a 1 GiB copy on a GPU,
    256 MiB on the CPU; best of 5."""
    import torch

    size = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def peak_memory(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated at peak"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident at peak"


def profile_decode(engine, batch: list[list[int]], steps: int, device: str) -> str:
    """Kernels and host<->device copies per decode step: torch.profiler started and stopped
    on the engine's scheduler thread (between two steps) around ~`steps` decode steps of
    the whole batch, once every row has decoded a few tokens."""
    from torch.profiler import ProfilerActivity, profile

    from areal_cli.inference.api import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=100_000, ignore_eos=True)
    futures = [engine.submit(GenerateRequest(input_ids=ids, sampling_params=params))
               for ids in batch]  # fmt: skip

    def decoded() -> int:
        progress = engine.stats().progress
        return min(progress.values()) if len(progress) == len(batch) else 0

    while decoded() < 3:
        time.sleep(0.01)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities)
    before = sum(engine.stats().progress.values())
    engine._call(prof.start)
    while sum(engine.stats().progress.values()) - before < steps * len(batch):
        time.sleep(0.001)
    engine._call(prof.stop)
    done = (sum(engine.stats().progress.values()) - before) / len(batch)
    engine.abort_all()
    for f in futures:
        f.result(600)
    events = prof.key_averages()

    def count(*names: str) -> float:
        return sum(e.count for e in events if e.key.startswith(names)) / done

    where = f"({done:.0f} steps of {len(batch)} rows)"
    if device != "cuda":
        return f"{count('aten::'):.0f} aten ops per step {where}"
    return (
        f"{count('cudaLaunchKernel', 'cuLaunchKernel'):.0f} kernel launches and "
        f"{count('cudaGraphLaunch'):.1f} graph launches, "
        f"{count('Memcpy DtoH'):.1f} device->host and {count('Memcpy HtoD'):.1f} "
        f"host->device copies per step {where}"
    )


def bench_speed(work: Path, setup: Setup, device: str, reps: int, skip_generate: bool,
                profile_steps: int, graphs: str) -> list[tuple[str, str]]:  # fmt: skip
    import torch

    from areal_cli.inference.engine import InferenceEngine

    folder, tokenizer = build_model(work / "bench-model", setup.shape, 0, setup.dtype)
    rows = Rows(("model", f"{describe(setup.shape, folder)}, {setup.dtype}; tokenizer {tokenizer}"))
    batch = prompts(setup.requests, setup.prompt_tokens, setup.shape["vocab_size"], seed=1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with InferenceEngine(
        folder, dtype=setup.dtype, device=device, max_running_requests=setup.requests,
        decode_graphs=graphs,
    ) as engine:  # fmt: skip
        engine_run(engine, batch, setup.new_tokens)  # warm-up
        runs = [
            engine_run(engine, batch, setup.new_tokens, seed=100 * (r + 1)) for r in range(reps)
        ]
        engine_rate = max(t / s for t, s in runs)
        # a colocated run's cycle: memory given back while the trainer steps, then taken
        # back; the graphs are captured again in the next run
        before = engine.graph_captures
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        resumed = engine_run(engine, batch, setup.new_tokens, seed=7)
        recaptured = engine.graph_captures - before
        one = batch[:1]
        engine_run(engine, one, setup.single_new_tokens)  # warm-up at batch 1
        long = min(
            s for _, s in (engine_run(engine, one, setup.single_new_tokens) for _ in range(3))
        )
        short = min(s for _, s in (engine_run(engine, one, 2) for _ in range(3)))
        step_ms = 1000 * (long - short) / (setup.single_new_tokens - 2)
        profile = profile_decode(engine, batch, profile_steps, device)
        weights = weight_bytes(engine.model)
        rows.append(("decode steps", engine.decode_graphs_info))
    memory = peak_memory(device)
    bound_ms = 1000 * weights / copy_rate(device)
    times = ", ".join(f"{t / s:,.0f}" for t, s in runs)
    rows.append((f"engine {setup.requests}x{setup.new_tokens}",
                 f"{engine_rate:,.0f} tokens/s (best of {times})"))  # fmt: skip
    rows.append(("same, after release+resume",
                 f"{resumed[0] / resumed[1]:,.0f} tokens/s, {recaptured} graphs captured "
                 f"again ({resumed[0] / resumed[1] / engine_rate:.2f}x the best run)"))  # fmt: skip
    if not skip_generate:
        hf = load_hf(folder, setup.dtype, device)
        generate_run(hf, batch[:2], 4)  # warm-up
        gen = [generate_run(hf, batch, setup.new_tokens) for _ in range(reps)]
        gen_rate = max(t / s for t, s in gen)
        rows.append(("model.generate, same batch", f"{gen_rate:,.0f} tokens/s"))
        rows.append(("engine / generate", f"{engine_rate / gen_rate:.2f}x (goal >= 5x on the GPU)"))
        del hf
    rows.append(("batch 1 decode step",
                 f"{step_ms:.2f} ms ({1000 / step_ms:,.0f} tokens/s); bandwidth bound "
                 f"{bound_ms:.3f} ms ({weights / 2**20:,.0f} MiB of weights); ratio "
                 f"{step_ms / bound_ms:.1f}x (goal <= 2 ms on an H200)"))  # fmt: skip
    rows.append(("profile, decode at batch", profile))
    rows.append(("peak memory", memory))
    return rows


def check_exactness(
    work: Path, setup: Setup, device: str, graphs: str
) -> list[tuple[str, bool, str]]:
    """The engine against transformers on a smaller float32 Llama (see the docstring)."""
    import random

    import torch
    from gpu_check import logprob_gap  # scripts/, this script's folder

    from areal_cli.inference.api import GenerateRequest, SamplingParams
    from areal_cli.inference.engine import InferenceEngine

    folder, _ = build_model(work / "exact-model", setup.exact_shape, seed=3)
    vocab = setup.exact_shape["vocab_size"]
    hf = load_hf(folder, "float32", device)
    rng = random.Random(5)
    mixed = [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 96))] for _ in range(64)]
    rows = Rows()
    with InferenceEngine(
        folder, dtype="float32", device=device, max_running_requests=64, decode_graphs=graphs
    ) as engine:

        def request(ids: list[int], temperature: float, seed: int, new: int = 24):
            params = SamplingParams(temperature=temperature, max_new_tokens=new,
                                    ignore_eos=True, sampling_seed=seed)  # fmt: skip
            return GenerateRequest(input_ids=ids, sampling_params=params, return_logprob=True)

        # logprobs of sampled tokens against a teacher-forced forward
        worst = max(
            logprob_gap(engine, hf, request(ids, 1.0, i)) for i, ids in enumerate(mixed[:8])
        )
        rows.append(("exact: logprobs vs transformers (fp32)", worst <= 1e-5,
                     f"max |d| {worst:.1e} over 8 requests (bound 1e-5)"))  # fmt: skip

        # greedy: 32 mixed-length requests at once against model.generate one by one
        futures = [engine.submit(request(ids, 0.0, 0, new=32)) for ids in mixed[:32]]
        outs = [f.result(600) for f in futures]
        differ = 0
        for ids, out in zip(mixed[:32], outs, strict=True):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids], device=device), do_sample=False,
                                  max_new_tokens=32, pad_token_id=0)  # fmt: skip
            differ += ref[0, len(ids) :].tolist() != out.output_ids
        rows.append(("exact: greedy vs model.generate", differ == 0,
                     f"{32 - differ} of 32 mixed-length requests equal (lengths 3-96, 32 tokens)"))  # fmt: skip

        # a seeded request alone, then inside a batch of 64
        alone = engine.generate_sync(request(mixed[0], 1.0, 1234, new=48)).output_ids
        futures = [engine.submit(request(ids, 1.0, 1234 if i == 0 else 50 + i, new=48))
                   for i, ids in enumerate(mixed)]  # fmt: skip
        inside = [f.result(600) for f in futures][0].output_ids
        rows.append(("exact: seeded alone vs in a batch of 64", alone == inside,
                     f"{sum(a == b for a, b in zip(alone, inside, strict=True))} of {len(alone)} tokens equal"))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- trainer (issue 45)


@dataclass(frozen=True)
class TrainSetup:
    """The trainer benchmark's batches: `seqs` sequences of `prompt` tokens plus a
    completion of `completion` tokens (equal lengths) or drawn uniformly from `mixed`."""

    seqs: int
    prompt: int
    completion: int
    mixed: tuple[int, int]
    mb_tokens: int
    steps: int
    compile: bool = False  # the trainer with actor.compile


GPU_TRAIN = TrainSetup(128, 128, 384, (16, 1024), 16384, 4)
CPU_TRAIN = TrainSetup(16, 16, 48, (8, 96), 1024, 4)


def completions(setup: TrainSetup, mixed: bool, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    if not mixed:
        return [setup.completion] * setup.seqs
    return [rng.randint(*setup.mixed) for _ in range(setup.seqs)]


def rollout_batch(setup: TrainSetup, lengths: list[int], vocab: int, seed: int):
    """A GRPO batch (groups of 4) of random tokens, behaviour logprobs and rewards."""
    import torch

    from areal_cli.rundir.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        mask = torch.cat([torch.zeros(setup.prompt), torch.ones(n)]).to(torch.int8)
        seqs.append(
            {
                "input_ids": torch.randint(2, vocab, (setup.prompt + n,), generator=gen),
                "loss_mask": mask,
                "logprobs": (-torch.rand(setup.prompt + n, generator=gen) * 3 - 1) * mask,
                "versions": torch.where(mask.bool(), 0, -1).to(torch.int32),
            }
        )
    rewards = torch.randint(0, 2, (len(lengths),), generator=gen).float().tolist()
    return RolloutBatch.from_sequences(seqs, rewards, 4)


def areal_trainer(work: Path, name: str, folder: Path, batches: list, setup: TrainSetup,
                  device: str) -> tuple[float, float, str]:  # fmt: skip
    """`areal_cli.trainer.main` under torchrun, one rank (FSDP2, bf16 compute and fp32
    reduction on a GPU) on fixed batches: (median seconds of steps 2.., peak memory MiB,
    the attention kernel it reported)."""
    from areal_cli.rundir.batch import write_batch
    from tests.gloo.conftest import torchrun, write_config

    for step, batch in enumerate(batches, start=1):
        write_batch(work / f"{name}-batches", step, batch)
    keys: dict[str, object] = {
        "total_train_steps": len(batches),
        "allocation_mode": "embedded:d1+fsdp:d1",
        "rollout.batch_size": setup.seqs // 4,
        "actor.mb_spec.max_tokens_per_mb": setup.mb_tokens,
        "actor.optimizer.lr": 1e-6,
    }
    if setup.compile:
        keys["actor.compile"] = True
    if device == "cuda":
        keys |= {"cluster.n_gpus_per_node": 1, "actor.fsdp.param_dtype": "bfloat16",
                 "actor.fsdp.reduce_dtype": "float32"}  # fmt: skip
    config = write_config(work / f"{name}.yaml", folder, work / name, **keys)
    ran = torchrun(1, config, "--batches", str(work / f"{name}-batches"), "--dp", "1", timeout=600)
    said = [line.split("packed attention: ", 1)[1] for line in ran.stderr.splitlines()
            if "packed attention: " in line]  # fmt: skip
    kernel = "; ".join(said) or "buckets (SDPA per padded width)"
    records = [
        json.loads(line)
        for line in (work / name / "gloo" / "t" / "logs" / "trainer-metrics.jsonl").read_text().splitlines()
    ]  # fmt: skip
    steady = records[1:] or records
    peak = max(r.get("peak_device_mb") or r["peak_rss_mb"] for r in records)
    return statistics.median(r["train_s"] for r in steady), peak, kernel


def plain_loop(folder: Path, batches: list, setup: TrainSetup, device: str) -> tuple[float, float]:
    """What a user writes in an afternoon: fp32 master weights, bf16 autocast on a GPU,
    SDPA, fused AdamW, micro-batches of at most `mb_tokens` padded tokens (sequences in
    order, padded to the longest of their micro-batch), the token-level policy-gradient
    loss (advantage x importance ratio, mean over the step's trained tokens):
    (median seconds of steps 2.., peak memory MiB)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)  # fmt: skip
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for batch in batches:
        seqs = [batch.sequence(i) for i in range(len(batch.rewards))]
        groups = batch.rewards.float().view(-1, 4)
        adv = (groups - groups.mean(1, keepdim=True)).reshape(-1).tolist()
        trained = sum(int(s["loss_mask"].sum()) for s in seqs)
        sync(device)
        start = time.perf_counter()
        i = 0
        while i < len(seqs):
            j, longest = i, 0
            while j < len(seqs):
                wider = max(longest, len(seqs[j]["input_ids"]))
                if (j - i + 1) * wider > setup.mb_tokens:
                    break
                longest, j = wider, j + 1
            j = max(j, i + 1)
            longest = max(len(s["input_ids"]) for s in seqs[i:j])

            def pad(values: list[torch.Tensor], dtype: torch.dtype, width: int = longest):
                padded = [F.pad(v.to(dtype), (0, width - len(v))) for v in values]
                return torch.stack(padded).to(device)

            part = seqs[i:j]
            ids = pad([s["input_ids"] for s in part], torch.long)
            mask = pad([s["loss_mask"] for s in part], torch.float32)
            old = pad([s["logprobs"] for s in part], torch.float32)
            attn = pad([torch.ones(len(s["input_ids"])) for s in part], torch.long)
            a = torch.tensor(adv[i:j], device=device)[:, None]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                logits = model(input_ids=ids, attention_mask=attn).logits
            logp = -F.cross_entropy(
                logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none"
            )
            ratio = torch.exp(logp - old[:, 1:])
            loss = -(a * ratio * mask[:, 1:]).sum() / trained
            loss.backward()
            del logits, logp, ratio, loss
            i = j
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20  # fmt: skip
    del model, optimizer
    return statistics.median(times[1:] or times), peak


def matmul_rate(device: str) -> float:
    """FLOP/s of a square matmul in the compute dtype (bf16 on a GPU, fp32 on the CPU),
    best of 5: the denominator of MFU, measured here rather than taken from a datasheet."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n**3 / best


def bench_trainer(
    work: Path, setup: Setup, tsetup: TrainSetup, device: str
) -> list[tuple[str, str]]:
    """The trainer against the plain loop, at equal and at mixed lengths (the docstring)."""
    folder, _ = build_model(work / "train-model", setup.shape, 0, "float32")
    params = parameter_count(folder)
    rate = matmul_rate(device)
    vocab = setup.shape["vocab_size"]
    rows = Rows(("matmul rate (MFU's denominator)", f"{rate / 1e12:,.1f} TFLOP/s "
                 f"({'bf16 8192^3' if device == 'cuda' else 'fp32 1024^3'})"))  # fmt: skip
    for kind in ("equal", "mixed"):
        lengths = [completions(tsetup, kind == "mixed", seed=10 + s) for s in range(tsetup.steps)]
        batches = [rollout_batch(tsetup, ls, vocab, seed=s) for s, ls in enumerate(lengths)]
        tokens = statistics.mean(sum(tsetup.prompt + n for n in ls) for ls in lengths)
        ours, ours_peak, kernel = areal_trainer(work, f"train-{kind}", folder, batches, tsetup,
                                                device)  # fmt: skip
        plain, plain_peak = plain_loop(folder, batches, tsetup, device)
        mfu = lambda s, t=tokens: 6 * params * t / s / rate  # noqa: E731
        what = (f"{tsetup.seqs} x ({tsetup.prompt} + {tsetup.completion})" if kind == "equal"
                else f"{tsetup.seqs} x ({tsetup.prompt} + {tsetup.mixed[0]}..{tsetup.mixed[1]})")  # fmt: skip
        rows.append((f"trainer, {kind} lengths", f"{tokens / ours:,.0f} tokens/s, {ours:.3f} s/step, "
                     f"MFU {mfu(ours):.1%}, peak {ours_peak:,.0f} MiB ({what}, ~{tokens:,.0f} tokens); "
                     f"attention: {kernel}"))  # fmt: skip
        rows.append((f"plain loop, {kind} lengths", f"{tokens / plain:,.0f} tokens/s, {plain:.3f} s/step, "
                     f"MFU {mfu(plain):.1%}, peak {plain_peak:,.0f} MiB"))  # fmt: skip
        goal = "goal >= 1.0x, MFU >= 30%" if kind == "equal" else "goal >= 1.5x"
        rows.append((f"trainer / plain loop, {kind}", f"{plain / ours:.2f}x tokens/s, "
                     f"{ours_peak / plain_peak:.2f}x peak memory ({goal} on the GPU)"))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny model on the CPU (CI)")
    parser.add_argument("--part", default="engine,trainer", help="engine, trainer or both")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument(
        "--decode-graphs",
        choices=["auto", "cuda", "eager", "off"],
        default="auto",
        help="auto: cuda on the GPU, eager under --cpu (see the docstring)",
    )
    parser.add_argument(
        "--trainer-attention",
        choices=["auto", "varlen", "buckets"],
        default="auto",
        help="the trainer's packed attention kernel (see the docstring)",
    )
    parser.add_argument(
        "--trainer-compile", action="store_true", help="the trainer with actor.compile"
    )
    args = parser.parse_args(argv)
    os.environ["AREAL_TRAINER_ATTENTION"] = args.trainer_attention  # the trainer ranks read it
    parts = set(args.part.split(","))
    if not parts or parts - {"engine", "trainer"}:
        parser.error(f"--part takes engine, trainer or engine,trainer (got {args.part!r})")

    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu, or on a machine with a GPU", file=sys.stderr)
        return 2
    setup = CPU if args.cpu else GPU
    graphs = args.decode_graphs
    if graphs == "auto":
        graphs = "eager" if args.cpu else "cuda"
    start = time.perf_counter()
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    speed: list[tuple[str, str]] = []
    exact: list[tuple[str, bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="areal-gpu-bench-") as tmp:
        work = Path(tmp)
        if "engine" in parts:
            speed += bench_speed(work, setup, device, args.reps, args.skip_generate,
                                 args.profile_steps, graphs)  # fmt: skip
            exact += check_exactness(work, setup, device, graphs)
        if "trainer" in parts:
            tsetup = dataclasses.replace(CPU_TRAIN if args.cpu else GPU_TRAIN,
                                         compile=args.trainer_compile)  # fmt: skip
            speed += bench_trainer(work, setup, tsetup, device)
    print(f"gpu_bench{' (--cpu)' if args.cpu else ''}: torch {torch.__version__} on {where}")
    width = max(len(name) for name, *_ in speed + exact)
    for name, figures in speed:
        print(f"{name:<{width}}        {figures}")
    for name, ok, figures in exact:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}  {figures}")
    print(f"{time.perf_counter() - start:.0f} s in all")
    return 0 if all(ok for _, ok, _ in exact) else 1


if __name__ == "__main__":
    sys.exit(main())

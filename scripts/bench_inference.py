"""Throughput of the embedded server against plain `model.generate()` and vLLM, and weight-reload time.

Usage: python scripts/bench_inference.py [--preset tiny|small | --model DIR] [--requests 64]
       [--new-tokens 8-128] [--max-running-requests 16] [--threads 1] [--temperature 0]
       [--seed 0] [--repeats 3] [--reloads 3] [--dtype float32,bfloat16] [--workdir DIR]
       [--vllm-python PY] [--no-hf]
  e.g. make smollm2 vllm; python scripts/bench_inference.py
       --model ~/.cache/areal/models/smollm2-135m-instruct --requests 128 --new-tokens 16-128
       --max-running-requests 128 --repeats 2 --no-hf

One run, one model (the builtin preset, built offline, or the Hugging Face folder
--model), one fixed set of requests with mixed prompt lengths (8-64 tokens) and output
lengths (max_new_tokens in --new-tokens, ignore_eos, so every request produces exactly
its length):

  (a) embedded server: a real `python -m areal_cli.inference.server` subprocess on
      loopback, all requests sent at once through the async `InferenceClient`;
  (b) Hugging Face: `model.generate()` on static batches, in request order, left-padded
      (left out with --no-hf);
  (c) vLLM, when its interpreter is there (--vllm-python, default .venv-vllm/bin/python
      from `make vllm`; '' leaves it out): its real OpenAI server with the command line
      and environment `areal train` gives it (backends.vllm: serve_argv / vllm_env; eager mode),
      --max-num-seqs = --max-running-requests, the same requests through the same client
      (backend vllm), after the embedded server has stopped. Its OpenMP threads: by default vLLM's own choice (on a 2-core
      machine one core for the model, the other left to its API server process), or
      --vllm-bind threads. Its CPU time counts the API server and the engine core.

Fairness: the static batch size equals the server's --max-running-requests (the most
requests it decodes together). The embedded server and HF get the same number of torch
threads (--threads: OMP_NUM_THREADS/MKL_NUM_THREADS for the server, torch.set_num_threads
here; --threads = the machine's cores is what `areal serve` uses)
and run one after the other, never at the same time. Both use the same sampling
(greedy by default; with --temperature T both sample from the full softmax at T).
Each --dtype (default: float32 and bfloat16, side by side) runs the whole comparison with
every side in that dtype; bf16 uses the CPU's AVX-512 BF16 / AMX units where it has them.
The last line compares each dtype's server throughput with the first's, and for greedy
decoding how many requests produced the same tokens in both.
Throughput counts only requested tokens: a static batch keeps decoding a short request
until its longest neighbour is done, and those extra tokens are waste, not output.
Both sides are warmed up, then timed alternately --repeats times; the best run of each
counts (the machine may be shared, and other load only ever slows a run down). CPU time
(of the server process, all threads; of this process for HF) is reported as well: it is
less sensitive to other tenants than the wall clock.

Weight reload: `/update_weights_from_disk` to a second checkpoint of the same
architecture, timed from request to response, against reading the same safetensors
bytes from disk. Before each timing the files' page cache is dropped with
posix_fadvise(DONTNEED) (checked with `fincore` when present); when that is not possible
the files are a fresh copy written just before, i.e. read from a warm page cache. The
output says which.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from areal_cli.inference.client import InferenceClient
from areal_cli.launch.local import ServerProcess, start_server
from areal_cli.launch.ports import free_port
from areal_cli.models.tiny_model import build_tiny_model, count_parameters

REPO = Path(__file__).resolve().parents[1]

FIRST_ORDINARY_ID = 10  # below are the special tokens of the builtin tokenizer


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class Throughput:
    tokens: int
    seconds: float  # wall clock
    cpu_seconds: float  # CPU time of the generating process, all its threads
    outputs: list[list[int]]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu_seconds


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants, all threads (Linux
    /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]
    return own + sum(cpu_seconds(c) for c in children)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--model", type=Path, help="A Hugging Face folder instead of --preset.")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", default="8-128", help="MIN-MAX of max_new_tokens.")
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", default="float32,bfloat16", help="Comma-separated dtypes, run in turn."
    )
    parser.add_argument("--workdir", type=Path, default=Path("~/.cache/areal/bench"))
    parser.add_argument("--repeats", type=int, default=3, help="Throughput runs (best).")
    parser.add_argument("--reloads", type=int, default=3, help="Reload timings (median); 0: none.")
    default_vllm = REPO / ".venv-vllm" / "bin" / "python"
    parser.add_argument(
        "--vllm-python",
        default=str(default_vllm) if default_vllm.exists() else "",
        help="vLLM's interpreter ('' leaves vLLM out).",
    )
    parser.add_argument(
        "--vllm-bind",
        default="auto",
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (its own choice) or threads (the "
        "first --threads cores, as areal train binds a server to its plan's cores).",
    )
    parser.add_argument("--no-hf", action="store_true", help="Leave model.generate() out.")
    return parser.parse_args()


def make_requests(n: int, vocab: int, seed: int, new_tokens: str) -> list[Request]:
    rng = random.Random(seed)
    low, high = (int(x) for x in new_tokens.split("-"))
    return [
        Request(
            [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(8, 64))],
            rng.randint(low, high),
        )
        for _ in range(n)
    ]


def sampling(req: Request, temperature: float) -> dict:
    return {
        "temperature": temperature,
        "max_new_tokens": req.max_new_tokens,
        "ignore_eos": True,
    }


# --------------------------------------------------------------------------- (a) server


def start(model: Path, args: argparse.Namespace, log: Path, dtype: str) -> ServerProcess:
    port = free_port()
    argv = [
        sys.executable, "-m", "areal_cli.inference.server", "--model-path", str(model),
        "--port", str(port), "--device", "cpu", "--dtype", dtype,
        "--max-running-requests", str(args.max_running_requests),
        "--weight-root", str(log.parent),  # the reload timing loads copies made there
    ]  # fmt: skip
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": ""}
    return start_server(argv, log, f"http://127.0.0.1:{port}", env=env, timeout_s=300)


def start_vllm(model: Path, args: argparse.Namespace, log: Path, dtype: str) -> ServerProcess:
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.inference.backends import BACKENDS, ServeOptions
    from areal_cli.inference.backends.vllm import vllm_env

    port = free_port()
    options = ServeOptions(str(model), port=port, dtype=dtype)
    argv = BACKENDS["vllm"].serve_argv(options, args.vllm_python)
    argv += ["--max-num-seqs", str(args.max_running_requests), "--max-model-len", "1024"]
    cores = list(range(args.threads)) if args.vllm_bind == "threads" else []
    env = {**vllm_env(ExperimentConfig(), "cpu", cores), "OMP_NUM_THREADS": "1"}
    return start_server(argv, log, f"http://127.0.0.1:{port}", env=env, timeout_s=600)


async def bench_server(
    server: ServerProcess, reqs: list[Request], temperature: float, backend: str = "sglang"
) -> Throughput:
    """All requests at once through the async client; the clock covers the whole set."""
    async with InferenceClient([server.url], timeout_s=3600, retries=0, backend=backend) as client:
        cpu, begin = cpu_seconds(server.pid), time.perf_counter()
        answers = await asyncio.gather(
            *(client.generate(r.prompt, sampling(r, temperature)) for r in reqs)
        )
        seconds, cpu = time.perf_counter() - begin, cpu_seconds(server.pid) - cpu
    outputs = [a["output_ids"] for a in answers]
    assert [len(o) for o in outputs] == [r.max_new_tokens for r in reqs]
    return Throughput(sum(len(o) for o in outputs), seconds, cpu, outputs)


# --------------------------------------------------------------------------- (b) HF


def hf_generate(
    model: torch.nn.Module, batch: list[Request], pad: int, temperature: float
) -> tuple[torch.Tensor, int]:
    """One static batch, left-padded; never stops early (ignore_eos on every row)."""
    width = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    longest = max(r.max_new_tokens for r in batch)
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=longest,
        min_new_tokens=longest,
        eos_token_id=None,
        pad_token_id=pad,
        **(sample if temperature > 0 else {"do_sample": False}),
    )
    return out[:, width:], longest * len(batch)


def load_hf(model_dir: Path, threads: int, dtype: str) -> torch.nn.Module:
    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def bench_hf(
    model: torch.nn.Module, reqs: list[Request], size: int, temperature: float
) -> tuple[Throughput, int]:
    """Static batches of `size` in request order; returns the throughput and how many
    tokens were decoded in all (requested plus waste)."""
    pad = model.generation_config.pad_token_id or 0
    batches = [reqs[i : i + size] for i in range(0, len(reqs), size)]
    with torch.inference_mode():
        cpu, begin = time.process_time(), time.perf_counter()
        results = [hf_generate(model, b, pad, temperature) for b in batches]
        seconds, cpu = time.perf_counter() - begin, time.process_time() - cpu
    outputs = [
        row[: r.max_new_tokens].tolist()
        for (rows, _), batch in zip(results, batches, strict=True)
        for row, r in zip(rows, batch, strict=True)
    ]
    generated = sum(n for _, n in results)
    return Throughput(sum(r.max_new_tokens for r in reqs), seconds, cpu, outputs), generated


# --------------------------------------------------------------------------- reload


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def evict(files: list[Path]) -> bool:
    """Drop the files' page cache; True when `fincore` confirms nothing stays resident."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return False
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
    )
    return out.returncode == 0 and all(v.strip() == "0" for v in out.stdout.split())


def fresh_copy(source: Path, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    return Path(shutil.copytree(source, dest))


def bench_reload(
    url: str, alt: Path, work: Path, repeats: int, backend: str = "sglang"
) -> tuple[float, float, int, bool]:
    """Median seconds of the reload and of the raw read, the bytes, and whether cold."""
    reload_s, read_s, cold = [], [], True

    async def reload(path: Path, version: str) -> float:
        async with InferenceClient([url], timeout_s=600, retries=0, backend=backend) as client:
            begin = time.perf_counter()
            await client.update_weights_from_disk(str(path), version)
            return time.perf_counter() - begin

    for i in range(repeats):
        copy = fresh_copy(alt, work / f"reload-{i}")
        cold &= evict(weight_files(copy))
        reload_s.append(asyncio.run(reload(copy, str(i + 1))))
        shutil.rmtree(copy)  # the server has copied the tensors in; the folder is not used
        copy = fresh_copy(alt, work / f"read-{i}")
        files = weight_files(copy)
        cold &= evict(files)
        begin = time.perf_counter()
        size = sum(len(path.read_bytes()) for path in files)
        read_s.append(time.perf_counter() - begin)
        shutil.rmtree(copy)
    return statistics.median(reload_s), statistics.median(read_s), size, cold


# --------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    if args.model is not None:
        model_dir = alt_dir = args.model.resolve()  # reloads read the same weights again
        work = args.workdir.expanduser() / model_dir.name
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = args.workdir.expanduser() / args.preset
        model_dir = build_tiny_model(work / "seed0", args.preset, seed=0)
        alt_dir = build_tiny_model(work / "seed1", args.preset, seed=1)
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    reqs = make_requests(args.requests, vocab, args.seed, args.new_tokens)
    best: dict[str, tuple[Throughput, Throughput | None]] = {}
    for i, dtype in enumerate(args.dtype.split(",")):
        best[dtype] = compare(
            args, dtype, model_dir, alt_dir if i == 0 and args.reloads > 0 else None, reqs, work
        )
    (first, (base, _)), *rest = best.items()
    for dtype, (run, _) in rest:
        line = f"{dtype} vs {first}: server {run.rate / base.rate:.2f}x tokens/s"
        if args.temperature == 0:
            same = sum(a == b for a, b in zip(run.outputs, base.outputs, strict=True))
            line += f"; greedy outputs identical in {same}/{len(reqs)} requests"
        print(line)
    for dtype, (run, vllm) in best.items():
        if vllm is not None:
            print(
                f"{dtype}: embedded {run.rate:.0f} tokens/s vs vLLM {vllm.rate:.0f} tokens/s: "
                f"{run.rate / vllm.rate:.2f}x (per CPU-second {run.cpu_rate / vllm.cpu_rate:.2f}x)"
            )
    return 0


def compare(
    args: argparse.Namespace,
    dtype: str,
    model_dir: Path,
    alt_dir: Path | None,
    reqs: list[Request],
    work: Path,
) -> tuple[Throughput, Throughput | None]:
    """The server against HF and vLLM in `dtype` (and the reload timing when `alt_dir` is
    given); returns the best run of the embedded server and of vLLM (None without it)."""
    model = load_hf(model_dir, args.threads, dtype)
    size = args.max_running_requests
    server = start(model_dir, args, work / f"server-{dtype}.log", dtype)
    try:
        # Warm both up, then alternate so that load from other processes hits both alike;
        # an idle server uses no CPU while HF runs.
        asyncio.run(bench_server(server, reqs[:4], args.temperature))
        if not args.no_hf:
            bench_hf(model, [Request(r.prompt, 4) for r in reqs[:4]], size, args.temperature)
        ours, hf = [], []
        for _ in range(args.repeats):
            ours.append(asyncio.run(bench_server(server, reqs, args.temperature)))
            if not args.no_hf:
                hf.append(bench_hf(model, reqs, size, args.temperature))
        if alt_dir is not None:
            reload = bench_reload(server.url, alt_dir, work, args.reloads)
    finally:
        server.stop()
    # vLLM only once the embedded server is gone: with an idle bf16 vLLM server alive (it
    # used ~1 CPU-s meanwhile), the embedded one ran at 206 tokens/s instead of 354 here.
    theirs: list[Throughput] = []
    if args.vllm_python:
        vllm = start_vllm(model_dir, args, work / f"vllm-{dtype}.log", dtype)
        try:
            asyncio.run(bench_server(vllm, reqs[:4], args.temperature, "vllm"))
            for _ in range(args.repeats):
                theirs.append(asyncio.run(bench_server(vllm, reqs, args.temperature, "vllm")))
            if alt_dir is not None:
                vllm_reload = bench_reload(vllm.url, alt_dir, work, args.reloads, "vllm")
        finally:
            vllm.stop(grace_s=10)
    print(f"== {dtype}")
    report(args, reqs, ours, [h for h, _ in hf], hf[0][1] if hf else 0, count_parameters(model))
    if theirs:
        report_vllm(args, reqs, ours, theirs)
    if alt_dir is not None:
        print_reload("embedded /update_weights_from_disk", reload, args.reloads)
        if theirs:
            print_reload("vLLM pause + reload_weights + resume", vllm_reload, args.reloads)
    return _best(ours), _best(theirs) if theirs else None


def _best(runs: list[Throughput]) -> Throughput:
    return min(runs, key=lambda r: r.seconds)


def print_reload(what: str, reload: tuple[float, float, int, bool], count: int) -> None:
    reload_s, read_s, nbytes, cold = reload
    how = "page cache dropped before each (posix_fadvise, checked with fincore)"
    if not cold:
        how = "page cache NOT verified dropped: a fresh copy written just before (warm)"
    print(
        f"weight reload: {what} {reload_s:.3f} s vs raw read {read_s:.3f} s of the same "
        f"{nbytes / 1e6:.1f} MB ({reload_s / read_s:.1f}x; median of {count}; {how})"
    )


def report(
    args: argparse.Namespace,
    reqs: list[Request],
    ours: list[Throughput],
    hf: list[Throughput],
    generated: int,
    params: int,
) -> None:
    mode = "greedy" if args.temperature == 0 else f"sampled at T={args.temperature}"
    size = args.max_running_requests
    best_ours = _best(ours)
    prompts = [len(r.prompt) for r in reqs]
    lengths = [r.max_new_tokens for r in reqs]
    name = args.model.name if args.model is not None else f"preset {args.preset}"
    print(
        f"{name} ({params / 1e6:.1f}M params), {len(reqs)} requests, prompts "
        f"{min(prompts)}-{max(prompts)} tokens, outputs {min(lengths)}-{max(lengths)} tokens "
        f"({sum(lengths)} in all), {mode}, {args.threads} torch thread(s) for embedded and HF, "
        f"best of {args.repeats} alternating runs"
    )
    cpu_ours = max(r.cpu_rate for r in ours)
    print(
        f"embedded server (HTTP, continuous batching, max_running_requests={size}): "
        f"{best_ours.rate:.0f} tokens/s, {cpu_ours:.0f} tokens per CPU-second "
        f"(runs: {_times(ours)})"
    )
    if not hf:
        return
    best_hf = _best(hf)
    cpu_hf = max(r.cpu_rate for r in hf)
    print(
        f"HF model.generate (static batches of {size}, left-padded): {best_hf.rate:.0f} "
        f"tokens/s, {cpu_hf:.0f} tokens per CPU-second (runs: {_times(hf)}; "
        f"{generated} tokens decoded per run incl. waste)"
    )
    print(
        f"ratio embedded/HF: {best_ours.rate / best_hf.rate:.2f} (wall clock), "
        f"{cpu_ours / cpu_hf:.2f} (CPU time)"
    )
    if args.temperature == 0:
        same = sum(a == h for a, h in zip(best_ours.outputs, best_hf.outputs, strict=True))
        print(f"greedy outputs identical in both: {same}/{len(reqs)} requests")


def report_vllm(
    args: argparse.Namespace, reqs: list[Request], ours: list[Throughput], theirs: list[Throughput]
) -> None:
    best = _best(theirs)
    print(
        f"vLLM (eager, max_num_seqs={args.max_running_requests}, OpenMP threads bound: "
        f"{args.vllm_bind}): {best.rate:.0f} tokens/s, "
        f"{max(r.cpu_rate for r in theirs):.0f} tokens per CPU-second (runs: {_times(theirs)})"
    )
    if args.temperature == 0:
        same = sum(a == b for a, b in zip(_best(ours).outputs, best.outputs, strict=True))
        print(f"greedy outputs identical in embedded and vLLM: {same}/{len(reqs)} requests")


def _times(runs: list[Throughput]) -> str:
    return ", ".join(f"{r.seconds:.2f} s wall/{r.cpu_seconds:.2f} s CPU" for r in runs)


if __name__ == "__main__":
    sys.exit(main())

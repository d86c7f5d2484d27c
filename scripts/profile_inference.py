"""Where the embedded server's engine spends its time, by torch operator.

Usage: python scripts/profile_inference.py [--model DIR | --preset tiny|small] [--batch 128]
       [--workload steady|mixed] [--dtype bfloat16] [--threads 1] [--prompt 32]
       [--skip 4] [--seconds 4] [--rows 25] [--shapes]
  e.g. make smollm2; python scripts/profile_inference.py
       --model ~/.cache/areal/models/smollm2-135m-instruct --batch 128 --dtype bfloat16

Runs the real `InferenceEngine` in this process; torch.profiler is started and stopped
on the engine's scheduler thread.
  steady: `--batch` requests of `--prompt` random tokens each, ignore_eos, long enough to
          keep decoding together. Once every row has decoded --skip tokens, --seconds of
          pure decode steps are recorded.
  mixed:  bench_inference.py's workload (greedy, --batch requests at once, prompts of
          8-64 tokens, 16-128 new tokens each), recorded from the first submission to
          the last answer: prefill, decode and a shrinking batch.
Prints the rate, the time in admission (prefill) and decode steps, the share of self
CPU time in attention, the linear layers and the rest (element-wise ops, sampling), and
the operators by self CPU time (--shapes: by operator and input shapes).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from areal_cli.inference.api import GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine
from areal_cli.models.tiny_model import build_tiny_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workload", choices=["steady", "mixed"], default="steady")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument(
        "--skip", type=int, default=4, help="Tokens every row decodes before the profile."
    )
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument(
        "--shapes", action="store_true", help="List the operators by input shapes too."
    )
    parser.add_argument("--workdir", type=Path, default=Path("~/.cache/areal/bench"))
    return parser.parse_args()


GROUPS = {
    "attention": ("scaled_dot_product", "flash_attention", "_efficient_attention"),
    "linear": (
        "aten::addmm",
        "aten::mm",
        "aten::bmm",
        "aten::linear",
        "aten::matmul",
        "mkldnn::_linear_pointwise",
    ),
}


def request(engine: InferenceEngine, rid: str, prompt: int, new: int, temperature: float):
    rng = random.Random(rid)
    return engine.submit(
        GenerateRequest(
            input_ids=[rng.randrange(10, engine.vocab_size) for _ in range(prompt)],
            sampling_params=SamplingParams(
                temperature=temperature, max_new_tokens=new, ignore_eos=True
            ),
            rid=rid,
        )
    )


def steady(engine: InferenceEngine, args: argparse.Namespace) -> tuple[profile, float, int, str]:
    """--seconds of decode steps of a full batch, after every row decoded --skip tokens."""
    futures = [request(engine, f"p{i}", args.prompt, 2000, 1.0) for i in range(args.batch)]
    progress = engine.stats().progress
    while len(progress) < args.batch or min(progress.values()) < args.skip:
        time.sleep(0.05)
        progress = engine.stats().progress
    before = sum(progress.values())
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes)
    begin = time.perf_counter()
    engine._call(prof.start)  # on the scheduler thread, between two steps
    time.sleep(args.seconds)
    engine._call(prof.stop)
    seconds = time.perf_counter() - begin
    tokens = sum(engine.stats().progress.values()) - before
    engine.abort_all()
    for f in futures:
        f.result(timeout=60)
    steps = tokens / args.batch
    label = (
        f"batch {args.batch}, prompt {args.prompt}, from token {args.skip}: "
        f"{seconds / steps * 1e3:.1f} ms per decode step"
    )
    return prof, seconds, tokens, label


def mixed(engine: InferenceEngine, args: argparse.Namespace) -> tuple[profile, float, int, str]:
    """bench_inference.py's workload, greedy: --batch requests at once, prompts of 8-64
    tokens, 16-128 new ones each; profiled from the first submission to the last answer."""
    rng = random.Random(0)
    shapes = [(rng.randint(8, 64), rng.randint(16, 128)) for _ in range(args.batch)]
    request(engine, "warm", 8, 4, 0.0).result(timeout=600)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes)
    engine._call(prof.start)
    begin = time.perf_counter()
    futures = [request(engine, f"m{i}", p, n, 0.0) for i, (p, n) in enumerate(shapes)]
    tokens = sum(len(f.result(timeout=3600).output_ids) for f in futures)
    seconds = time.perf_counter() - begin
    engine._call(prof.stop)
    return prof, seconds, tokens, f"{args.batch} mixed requests in {seconds:.1f} s"


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        model = build_tiny_model(args.workdir.expanduser() / args.preset / "seed0", args.preset)
    engine = InferenceEngine(model, dtype=args.dtype, device="cpu", max_running_requests=args.batch)
    try:
        if args.workload == "steady":
            prof, seconds, tokens, label = steady(engine, args)
        else:
            prof, seconds, tokens, label = mixed(engine, args)
    finally:
        engine.shutdown()
    print(
        f"{Path(model).name}, {args.dtype}, {args.threads} thread(s), {label}: "
        f"{tokens / seconds:.0f} tokens/s"
    )
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    shares = {name: 0.0 for name in GROUPS}
    for e in events:
        for name, keys in GROUPS.items():
            if any(k in e.key for k in keys):
                shares[name] += e.self_cpu_time_total
    rest = total - sum(shares.values())
    spans = {
        e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key in ("admit", "decode")
    }
    print("inside the steps: " + ", ".join(f"{k} {v:.2f} s" for k, v in spans.items()))
    print(
        "self CPU time: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in shares.items())
        + f", the rest {rest / total:.0%}"
    )
    table = prof.key_averages(group_by_input_shape=args.shapes)
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

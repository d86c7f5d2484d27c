"""Usage: python scripts/gpu_check.py [--cpu] [--out DIR] [--steps 24]
       (or bash scripts/gpu_check.sh [--cpu], which sets up the environment first)

The checks to run the moment a machine with one NVIDIA GPU is lent (torch with CUDA,
transformers, aiohttp, typer, rich, safetensors, pytest; no network, no SGLang or vLLM).
Only this repository is needed there. `--cpu` runs the same steps on the CPU (gloo
instead of nccl), which CI does (tests/e2e/test_gpu_check.py), so the script cannot rot.

  trainer     under real torchrun, one rank, on random rollout batches of a ~100k Llama:
              fp32 in one micro-batch against two (the exactness check at one rank: the
              same loss and weights), and FSDP2 with bf16 compute (mixed precision wraps
              even one rank, on nccl) against fp32 on the same batch;
  engine      the embedded engine's sampled logprobs against a teacher-forced
              transformers forward pass on the same device;
  colocated   the colocated demo (recipes/tiny_cpu_colocated.yaml: embedded:d1|fsdp:d1)
              on the device, learning: last-5 reward and seconds per step (on the GPU
              with bf16 compute, so that the trainer's FSDP2 shards are what it offloads
              between steps);
  throughput  builtin:small: the embedded engine's generation tokens/s (32 requests of
              64 tokens at once) and the trainer's step time (one rank, 3 steps).

It prints one summary table; the exit code is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

Row = tuple[str, bool, str]  # (check, passed, figures)


def _train(work: Path, name: str, model: Path, batches: Path, gpus: int, **keys: object) -> Path:
    """A trainer run of one rank on fixed batches; its run directory."""
    from tests.gloo.conftest import torchrun, write_config

    fileroot = work / name
    keys = {"cluster.n_gpus_per_node": gpus, "total_train_steps": 2, **keys}
    config = write_config(work / f"{name}.yaml", model, fileroot, **keys)
    torchrun(1, config, "--batches", str(batches), "--dp", "1", timeout=600)
    return fileroot / "gloo" / "t"  # the run directory write_config names


def check_trainer(work: Path, device: str) -> list[Row]:
    from tests.gloo.conftest import make_batches, make_model

    gpus = 1 if device == "cuda" else 0
    model = make_model(work / "model")
    batches = make_batches(work / "batches", 2)
    one = _train(work, "fp32-1mb", model, batches, gpus)
    two = _train(work, "fp32-2mb", model, batches, gpus, **{"actor.mb_spec.n_mbs": 2})
    bf16 = _train(
        work, "bf16", model, batches, gpus,
        **{"actor.fsdp.param_dtype": "bfloat16", "actor.fsdp.reduce_dtype": "float32"},
    )  # fmt: skip
    from tests.gloo.test_trainer import _max_diff, _metrics, _weights

    a, b, c = (_metrics(root) for root in (one, two, bf16))
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))
    wa, wb, wc = (_weights(root, 2) for root in (one, two, bf16))
    weight_diff = _max_diff(wa, wb)
    bf16_loss = max(
        abs(x["loss"] - y["loss"]) / max(1e-6, abs(x["loss"])) for x, y in zip(a, c, strict=True)
    )
    bf16_weights = _max_diff(wa, wc)
    backend = "nccl" if device == "cuda" else "gloo"
    return [
        (
            f"trainer: 1 vs 2 micro-batches, fp32, 1 rank ({backend})",
            loss_diff < 1e-5 and weight_diff < 1e-5,
            f"max |d loss| {loss_diff:.1e}, max |d weight| {weight_diff:.1e} (bound 1e-5)",
        ),
        (
            f"trainer: FSDP2 bf16 compute vs fp32, 1 rank ({backend})",
            bf16_loss < 0.05 and bf16_weights < 0.05,
            f"loss rel diff {bf16_loss:.1e}, max |d weight| {bf16_weights:.1e} (bound 5e-2)",
        ),
    ]


def check_engine(work: Path, device: str) -> list[Row]:
    import torch
    from transformers import AutoModelForCausalLM

    from areal_cli.inference.api import GenerateRequest, SamplingParams
    from areal_cli.inference.engine import InferenceEngine
    from areal_cli.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(work / "tiny", preset="tiny", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    worst = 0.0
    with InferenceEngine(model_dir, device=device) as engine:
        for i, prompt in enumerate([[5], [300, 12, 99], list(range(100, 131))]):
            params = SamplingParams(temperature=1.0, max_new_tokens=24, sampling_seed=i)
            request = GenerateRequest(input_ids=prompt, sampling_params=params, return_logprob=True)
            out = engine.generate_sync(request)
            ids = torch.tensor([prompt + out.output_ids], device=device)
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(out.output_ids, device=device)[:, None]
            )[:, 0]
            got = torch.tensor(out.output_logprobs, device=device)
            worst = max(worst, float((got - expected).abs().max()))
    return [
        (
            "engine: logprobs vs transformers (fp32)",
            worst < 1e-3,
            f"max |d| {worst:.1e} (bound 1e-3)",
        )
    ]


def check_colocated(work: Path, device: str, steps: int) -> list[Row]:
    overrides = [
        f"cluster.fileroot={work / 'runs'}", f"total_train_steps={steps}",
        "logging.display=plain", "logging.tensorboard=false",
    ]  # fmt: skip
    if device == "cuda":  # bf16 compute wraps the one rank in FSDP2: its offload is checked
        overrides += ["cluster.n_gpus_per_node=1", "inference.embedded.device=cuda"]
        overrides += ["actor.fsdp.param_dtype=bfloat16", "actor.fsdp.reduce_dtype=float32"]
    argv = [sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_cpu_colocated.yaml"]
    start = time.time()
    done = subprocess.run(
        argv + overrides, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"areal train failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (metrics,) = (work / "runs").glob("*/*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    rows = [r for r in rows if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows]
    last5 = statistics.fmean(rewards[-5:])
    step_s = (rows[-1]["time"] - rows[0]["time"]) / max(1, len(rows) - 1)
    colocated = all(r.get("colocated") == 1 for r in rows)
    target = 0.8 if steps >= 20 else rewards[0]  # a short run only has to run
    return [
        (
            "colocated demo: embedded:d1|fsdp:d1",
            colocated and len(rows) == steps and last5 >= target,
            f"{steps} steps, reward {rewards[0]:.3f} -> last-5 {last5:.3f}, "
            f"{step_s:.3f} s/step, {time.time() - start:.0f} s in all",
        )
    ]


def check_throughput(work: Path, device: str) -> list[Row]:
    import torch

    from areal_cli.inference.api import GenerateRequest, SamplingParams
    from areal_cli.inference.engine import InferenceEngine
    from areal_cli.launch.builtins import cached
    from tests.gloo.conftest import make_batches

    small = cached("small", 1)
    requests = [
        GenerateRequest(
            input_ids=[10 + i, 11, 12, 13],
            sampling_params=SamplingParams(
                temperature=1.0, max_new_tokens=64, ignore_eos=True, sampling_seed=i
            ),
            return_logprob=True,
        )
        for i in range(32)
    ]
    dtype = "bfloat16" if device == "cuda" else "float32"
    with InferenceEngine(small, device=device, dtype=dtype, max_running_requests=32) as engine:
        engine.generate_sync(requests[0])  # warm-up
        start = time.perf_counter()
        futures = [engine.submit(r) for r in requests]
        tokens = sum(len(f.result(600).output_ids) for f in futures)
        gen_s = time.perf_counter() - start
    vocab = json.loads((small / "config.json").read_text())["vocab_size"]
    batches = make_batches(work / "small-batches", 3, n_seqs=32, group_size=4, vocab=vocab)
    root = _train(
        work, "small", small, batches, 1 if device == "cuda" else 0, total_train_steps=3,
        **{"rollout.batch_size": 8},
    )  # fmt: skip
    from tests.gloo.test_trainer import _metrics

    step_s = statistics.median(r["train_s"] for r in _metrics(root)[1:])
    if device == "cuda":
        torch.cuda.synchronize()
    return [
        (
            f"throughput: builtin:small ({dtype} generation)",
            tokens == 32 * 64,
            f"generation {tokens / gen_s:.0f} tokens/s (32 x 64 at once); "
            f"trainer step {step_s:.3f} s (32 sequences, 1 rank)",
        )
    ]


def environment(device: str) -> str:
    import torch

    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    cuda = f", CUDA {torch.version.cuda}" if device == "cuda" else ""
    return f"torch {torch.__version__}{cuda} on {where}, python {sys.version.split()[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the same checks on the CPU")
    parser.add_argument("--out", type=Path, help="also write the table here (summary.txt)")
    parser.add_argument("--steps", type=int, default=24, help="the colocated demo's steps")
    args = parser.parse_args(argv)
    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --cpu for the CPU checks", file=sys.stderr)
        return 2
    checks: list[tuple[str, Callable[[Path], list[Row]]]] = [
        ("trainer", lambda w: check_trainer(w, device)),
        ("engine", lambda w: check_engine(w, device)),
        ("colocated", lambda w: check_colocated(w, device, args.steps)),
        ("throughput", lambda w: check_throughput(w, device)),
    ]
    rows: list[tuple[str, bool, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="areal-gpu-check-") as tmp:
        for name, check in checks:
            work = Path(tmp) / name
            work.mkdir()
            start = time.perf_counter()
            try:
                found = check(work)
            except Exception as exc:  # a failed check is a row of the table, not the end
                traceback.print_exc()
                found = [(name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")]
            took = time.perf_counter() - start
            rows += [(check_name, ok, figures, took) for check_name, ok, figures in found]
            print(f"[gpu_check] {name} done in {took:.1f}s", flush=True)
    width = max(len(r[0]) for r in rows)
    lines = [f"gpu_check ({'--cpu' if args.cpu else 'GPU'}): {environment(device)}"]
    lines += [f"{'check':<{width}}  result  seconds  figures"]
    lines += [
        f"{check:<{width}}  {'PASS' if ok else 'FAIL':<6}  {took:7.1f}  {figures}"
        for check, ok, figures, took in rows
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.txt").write_text(table + "\n")
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

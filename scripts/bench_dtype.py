"""Usage: python scripts/bench_dtype.py [--preset tiny|small | --model HF_FOLDER] [--requests 32]
       [--max-new-tokens 32] [--threads 2] [--steps 4] [--max-tokens-per-mb 4096]

bf16 against fp32 on this CPU, in one run on one model and one set of sequences:

  1. the embedded server (a real subprocess on loopback) in float32 and in bfloat16:
     tokens/s for the same requests (sampled at T=1 with a fixed seed, ignore_eos);
  2. the trainer's step on a 1-rank gloo group (the trainer's own `build_sharded_model`
     and `train_step`): fp32 parameters computing in fp32, and fp32 master parameters
     computing in bf16 (`actor.fsdp.param_dtype: bfloat16`, FSDP2 mixed precision);
  3. logprob agreement on the tokens the fp32 server sampled: the trainer in fp32 (the
     reference) against the fp32 server, the bf16 server and the bf16 trainer: mean and
     max |difference| over generated tokens, and the mean importance weight
     exp(reference - other) that decoupled PPO would see.

Both sides get --threads torch threads. Prints the figures and bf16/fp32 ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_trainer import free_port  # noqa: E402


def serve(model: Path, dtype: str, prompts: list[list[int]], args, log: Path) -> tuple[float, list]:
    """Tokens/s of one server in `dtype` (best of 2 after a warm-up), and its answers."""
    from bench_inference import start

    from areal_cli.inference.client import InferenceClient

    setting = argparse.Namespace(threads=args.threads, max_running_requests=len(prompts))
    server = start(model, setting, log, dtype)
    sampling = {"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}

    async def run(n: int) -> tuple[float, list]:
        async with InferenceClient([server.url], timeout_s=3600, retries=0) as client:
            begin = time.perf_counter()
            answers = await asyncio.gather(
                *(
                    client.generate(p, sampling | {"sampling_seed": i})
                    for i, p in enumerate(prompts[:n])
                )
            )
            return time.perf_counter() - begin, answers

    try:
        asyncio.run(run(4))
        seconds, answers = min(
            (asyncio.run(run(len(prompts))) for _ in range(2)), key=lambda r: r[0]
        )
    finally:
        server.stop()
    return len(prompts) * args.max_new_tokens / seconds, answers


def batch_of(prompts: list[list[int]], answers: list, group_size: int):
    from areal_cli.rundir.batch import RolloutBatch

    seqs = []
    for prompt, answer in zip(prompts, answers, strict=True):
        out = answer["output_ids"]
        lps = [float(x[0]) for x in answer["meta_info"]["output_token_logprobs"]]
        seqs.append(
            {
                "input_ids": torch.tensor(prompt + out),
                "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(out), dtype=torch.int8),
                "logprobs": torch.tensor([0.0] * len(prompt) + lps),
                "versions": torch.tensor([-1] * len(prompt) + [0] * len(out), dtype=torch.int32),
            }
        )
    rewards = [float(i % 2) for i in range(len(seqs))]
    return RolloutBatch.from_sequences(seqs, rewards, group_size)


def trainer(model_dir: Path, param_dtype: str, batch, args) -> tuple[float, torch.Tensor, dict]:
    """Median step time after one; before any step, the logprobs in label space (each
    position scores the next token) and the batch's tensors in that space."""
    from areal_cli.config.schema import FSDPEngineConfig, ParallelStrategy, TrainEngineConfig
    from areal_cli.trainer.mesh import build_mesh, step_layout
    from areal_cli.trainer.parallelize import build_sharded_model
    from areal_cli.trainer.step import forward_logprobs, train_step

    tmesh = build_mesh("cpu", ParallelStrategy())
    fsdp = FSDPEngineConfig(param_dtype=param_dtype)
    model = build_sharded_model(model_dir, tmesh, fsdp)
    layout = step_layout(tmesh, model.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        logp, _, labelled = forward_logprobs(model, batch, list(range(batch.n_seqs)), 1.0, layout)
    cfg = TrainEngineConfig()
    cfg.mb_spec.max_tokens_per_mb = args.max_tokens_per_mb
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        train_step(model, optimizer, None, batch, cfg, 1.0, layout=layout, policy_version=1)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:]), logp.float(), labelled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--model", type=Path, help="An HF folder instead of a builtin preset.")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-tokens-per-mb", type=int, default=4096)
    args = parser.parse_args()
    import torch.distributed as dist
    from transformers import AutoConfig

    from areal_cli.models.tiny_model import build_tiny_model

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="areal-bench-dtype-"))
    try:
        model_dir = args.model or build_tiny_model(work / "model", preset=args.preset, seed=0)
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(
                10, vocab, (int(torch.randint(8, 33, (1,), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(args.requests)
        ]
        rates, answers = {}, {}
        for dtype in ("float32", "bfloat16"):
            rates[dtype], answers[dtype] = serve(
                model_dir, dtype, prompts, args, work / f"{dtype}.log"
            )
        batch = batch_of(prompts, answers["float32"], group_size=4)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
        )
        dist.init_process_group("gloo")
        steps, logps = {}, {}
        for dtype in ("float32", "bfloat16"):
            steps[dtype], logps[dtype], labelled = trainer(model_dir, dtype, batch, args)
        dist.destroy_process_group()
        report(args, model_dir, batch, labelled, answers, prompts, rates, steps, logps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args, model_dir, batch, labelled, answers, prompts, rates, steps, logps) -> None:
    mask = labelled["loss_mask"].bool()
    reference = logps["float32"][mask]
    server_bf16 = batch_of(prompts, answers["bfloat16"], 4)
    print(
        f"model {model_dir}; {args.requests} requests x {args.max_new_tokens} new tokens "
        f"(sampled, T=1); trainer batch {batch.n_seqs} seqs, {int(batch.seqlens.sum())} tokens; "
        f"{args.threads} thread(s); bf16 hardware: "
        f"{'yes' if 'amx_bf16' in open('/proc/cpuinfo').read() else 'no AMX'}"
    )
    print(
        f"server tokens/s: fp32 {rates['float32']:.0f}  bf16 {rates['bfloat16']:.0f}  "
        f"ratio bf16/fp32 {rates['bfloat16'] / rates['float32']:.2f}x"
    )
    print(
        f"trainer step (1 rank, median of {args.steps - 1}): fp32 {steps['float32']:.3f} s  "
        f"bf16 compute {steps['bfloat16']:.3f} s  ratio {steps['bfloat16'] / steps['float32']:.2f}x"
    )
    print(
        "logprobs of generated tokens against the fp32 trainer: mean |d|, max |d|, mean exp(ref - x)"
    )
    others = {
        "fp32 server (its own tokens)": labelled["logprobs"][mask],
        "bf16 trainer": logps["bfloat16"][mask],
    }
    for name, values in others.items():
        d = reference - values.float()
        print(f"  {name:30s} {d.abs().mean():.2e}  {d.abs().max():.2e}  {d.exp().mean():.4f}")
    # the bf16 server sampled tokens of its own: a fp32 forward scores those
    d = _against_fp32(model_dir, server_bf16)
    name = "bf16 server (its own tokens)"
    print(f"  {name:30s} {d.abs().mean():.2e}  {d.abs().max():.2e}  {d.exp().mean():.4f}")


def _against_fp32(model_dir: Path, batch) -> torch.Tensor:
    """fp32 logprobs minus the batch's behaviour logprobs, over its generated tokens."""
    from transformers import AutoModelForCausalLM

    from areal_cli.trainer.losses import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs = []
    with torch.no_grad():
        for i in range(batch.n_seqs):
            t = batch.sequence(i)
            lp = token_logprobs(model(input_ids=t["input_ids"][None]).logits[0], t["input_ids"])
            m = t["loss_mask"].bool()
            diffs.append(lp[m] - t["logprobs"][m])
    return torch.cat(diffs)


if __name__ == "__main__":
    main()

"""Usage: python scripts/gpu_check.py [--cpu] [--out DIR] [--steps 24] [--only ppo,serve]
       (or bash scripts/gpu_check.sh [--cpu], which sets up the environment first)

The checks to run the moment a machine with one NVIDIA GPU is lent (torch with CUDA,
transformers, aiohttp, typer, rich, safetensors, pytest; no network, no SGLang or vLLM).
Only this repository is needed there. `--cpu` runs the same steps on the CPU (gloo
instead of nccl), which CI does (tests/e2e/test_gpu_check.py), so the script cannot rot.

  trainer     under real torchrun, one rank, on random rollout batches of a ~100k Llama:
              fp32 in one micro-batch against two (the exactness check at one rank: the
              same loss and weights), and FSDP2 with bf16 compute (mixed precision wraps
              even one rank, on nccl) against fp32 on the same batch; on a GPU also
              the packed attention's varlen kernel against per-sequence SDPA;
  engine      the embedded engine's sampled logprobs against a teacher-forced
              transformers forward pass on the same device;
  colocated   the colocated demo (recipes/tiny_cpu_colocated.yaml: embedded:d1|fsdp:d1)
              on the device, learning: last-5 reward and seconds per step (on the GPU
              with bf16 compute, so that the trainer's FSDP2 shards are what it offloads
              between steps);
  ppo         the PPO recipe (actor and critic) colocated on the device: 2 steps with a
              recover entry after each, --resume to 4 from recover/step-2 (DCP of the
              device's shards), then convert-checkpoint of recover/step-4 to HF --verify;
  supervised  the SFT and reward-model recipes, 4 steps each, with held-out metrics;
  eval        areal eval of the demo's initial model (its servers on the device);
  serve       areal serve of builtin:tiny-arith (on the GPU when there is one): one
              /generate with logprobs against transformers on the same device;
  memory      the embedded engine's release and resume of its memory: on a GPU
              torch.cuda.memory_allocated falls by at least the weights and KV cache and
              comes back, and a seeded request gives the same tokens after;
  throughput  builtin:small: the embedded engine's generation tokens/s (32 requests of
              64 tokens at once) and the trainer's step time (one rank, 3 steps).
On a GPU every trainer computes in bf16 (FSDP2 then wraps even one rank, on NCCL), and
every check that can runs on the device; --only picks checks (a rerun of what failed).

It prints one summary table; the exit code is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import math
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
        *check_lora_trainer(work, model, batches, gpus, backend),
        *check_varlen(device),
    ]


def check_varlen(device: str) -> list[Row]:
    """On a GPU: the trainer's varlen attention kernel (FlashAttention in torch) against
    per-sequence SDPA in float32, forward and query gradient, in bf16, for SmolLM2-360M's
    heads (15 over 5 of 64) and the test model's; on the CPU there is no such kernel."""
    if device != "cuda":
        return []
    import torch

    from areal_cli.trainer.attention import VARLEN_TOLERANCE, varlen_error

    errors = [varlen_error(torch.device("cuda"), torch.bfloat16, *shape)
              for shape in ((15, 5, 64), (4, 2, 16))]  # fmt: skip
    return [
        (
            "trainer: varlen attention vs per-sequence SDPA, bf16",
            max(errors) <= VARLEN_TOLERANCE,
            f"max error {max(errors):.1e} (bound {VARLEN_TOLERANCE}; 15/5 and 4/2 heads)",
        )
    ]


def check_lora_trainer(
    work: Path, model: Path, batches: Path, gpus: int, backend: str
) -> list[Row]:
    """LoRA (rank 4, all-linear): 1 vs 2 micro-batches in fp32 take the same step, and
    FSDP2's bf16 compute (frozen base and trained adapters in one wrapped block) stays
    near fp32; every published version is an adapter folder."""
    from tests.gloo.test_lora_trainer import LORA, _adapter

    runs = {
        "lora-1mb": {},
        "lora-2mb": {"actor.mb_spec.n_mbs": 2},
        "lora-bf16": {"actor.fsdp.param_dtype": "bfloat16", "actor.fsdp.reduce_dtype": "float32"},
    }
    roots = {
        name: _train(work, name, model, batches, gpus, **LORA, **keys)
        for name, keys in runs.items()
    }
    one, two, bf16 = (_adapter(roots[name], 2) for name in runs)

    def diff(a: dict, b: dict) -> float:
        return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

    exact, near = diff(one, two), diff(one, bf16)
    return [
        (
            f"trainer: LoRA 1 vs 2 micro-batches fp32, and bf16 compute, 1 rank ({backend})",
            exact < 1e-5 and near < 0.05,
            f"max |d adapter| {exact:.1e} (bound 1e-5); bf16 vs fp32 {near:.1e} (bound 5e-2); "
            f"{len(one)} adapter tensors per version",
        )
    ]


def logprob_gap(engine, hf, request) -> float:
    """Max |d| between the logprobs the engine reports for the tokens it samples for
    `request` and a teacher-forced forward of prompt + output through `hf` (transformers,
    on its own device). scripts/gpu_bench.py uses it too."""
    import torch

    out = engine.generate_sync(request)
    prompt, device = request.input_ids, hf.device
    ids = torch.tensor([prompt + out.output_ids], device=device)
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(
        1, torch.tensor(out.output_ids, device=device)[:, None]
    )[:, 0]
    got = torch.tensor(out.output_logprobs, device=device, dtype=torch.float32)
    return float((got - expected).abs().max())


def check_engine(work: Path, device: str) -> list[Row]:
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
            worst = max(worst, logprob_gap(engine, hf, request))
    rows = [
        (
            "engine: logprobs vs transformers (fp32)",
            worst < 1e-3,
            f"max |d| {worst:.1e} (bound 1e-3)",
        )
    ]
    if device == "cuda":
        rows.append(_uniforms_row(device))
    return rows


def _uniforms_row(device: str) -> Row:
    """A seeded request's random numbers (sampling.counter_uniforms, 64-bit integer
    arithmetic that wraps) are the same on the GPU as on the CPU, bit for bit."""
    import torch

    from areal_cli.inference.sampling import counter_uniforms

    seeds = torch.arange(-2000, 2000, dtype=torch.int64) * 0x1F1F1F1F1F1
    index = torch.arange(4000, dtype=torch.int64) % 700
    here = counter_uniforms(seeds, index)
    there = counter_uniforms(seeds.to(device), index.to(device)).cpu()
    same = int((here == there).sum())
    return ("engine: seeded draws equal on GPU and CPU", same == 4000, f"{same} of 4000 equal")


def _areal(work: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`areal ARGS` (the real CLI, in this repository); raises with its output's tail when
    it fails."""
    argv = [sys.executable, "-m", "areal_cli.cli", *args]
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )
    (work / f"areal-{args[0]}-{len(list(work.glob('areal-*.log')))}.log").write_text(
        done.stdout + done.stderr
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"areal {' '.join(args[:2])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def _run_overrides(work: Path, device: str, trial: str, server: bool = True) -> list[str]:
    """Where a check's run writes, and on a GPU the device settings: the trainer on
    NCCL with bf16 compute (FSDP2 then wraps even one rank, so its state is DTensor
    shards on the GPU), and with `server` (an RL run) the embedded server on the GPU."""
    out = [
        f"cluster.fileroot={work / 'runs'}", f"trial_name={trial}",
        "logging.display=plain", "logging.tensorboard=false",
    ]  # fmt: skip
    if device == "cuda":
        out += ["cluster.n_gpus_per_node=1"] + (
            ["inference.embedded.device=cuda"] if server else []
        )
        out += ["actor.fsdp.param_dtype=bfloat16", "actor.fsdp.reduce_dtype=float32"]
    return out


def recipe_runs(work: Path, device: str, steps: int = 24) -> dict[str, list[str]]:
    """The recipe and overrides of every `areal train` and `areal eval` the checks run, by
    name, with the device's settings; tests/unit/test_gpu_check_runs.py validates the GPU
    ones on a CPU, so a run that one GPU would refuse is caught before a GPU is lent."""
    eval_layout = []
    if device == "cuda":  # one GPU: the recipe's split layout would need two
        eval_layout = ["allocation_mode=embedded:d1|fsdp:d1", "rollout.max_staleness=0"]
    return {
        "colocated": [
            "recipes/tiny_cpu_colocated.yaml", f"total_train_steps={steps}",
            *_run_overrides(work, device, "colocated"),
        ],
        "ppo": [
            "recipes/tiny_ppo.yaml", "allocation_mode=embedded:d1|fsdp:d1",
            "rollout.max_staleness=0", "recover.freq_steps=1",
            *_run_overrides(work, device, "ppo"),
        ],
        "sft": [
            "recipes/tiny_sft.yaml", "total_train_steps=4", "sft.eval_freq_steps=4",
            *_run_overrides(work, device, "sft", server=False),
        ],
        "rm": [
            "recipes/tiny_rm.yaml", "total_train_steps=4", "rm.eval_freq_steps=4",
            *_run_overrides(work, device, "rm", server=False),
        ],
        "eval": [
            "recipes/tiny_cpu.yaml", "eval.max_prompts=50", "eval.n_samples=4",
            *_run_overrides(work, device, "eval"), *eval_layout,
        ],
    }  # fmt: skip


def _rows(run_dir: Path) -> list[dict]:
    """The trainer's step rows of a run's metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line) if r.get("kind") != "eval"]


def check_colocated(work: Path, device: str, steps: int) -> list[Row]:
    start = time.time()
    _areal(work, "train", *recipe_runs(work, device, steps)["colocated"])
    (run_dir,) = (work / "runs").glob("*/colocated")
    rows = [r for r in _rows(run_dir) if "reward_mean" in r]
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


def check_ppo_resume(work: Path, device: str) -> list[Row]:
    """The PPO recipe (actor and critic) colocated on the one device: 2 steps with a
    recover entry after each, then --resume to 4 steps from recover/step-2 (DCP of the
    device's shards, both models), then the last entry converted to HF with --verify."""
    args = recipe_runs(work, device)["ppo"]
    _areal(work, "train", *args, "total_train_steps=2")
    resumed = _areal(work, "train", *args, "total_train_steps=4", "--resume")
    (run_dir,) = (work / "runs").glob("*/ppo")
    rows = _rows(run_dir)
    steps = [r["step"] for r in rows]
    values = [r["value_loss"] for r in rows if "value_loss" in r]
    said = "from recover/step-2" in resumed.stdout
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    reloaded = "resumed from" in trainer_log and "recover/step-2" in trainer_log
    ppo_ok = steps == [1, 2, 3, 4] and len(values) == 4 and all(map(math.isfinite, values))
    start = time.perf_counter()
    converted = _areal(
        work, "convert-checkpoint", str(run_dir / "recover" / "step-4"), str(work / "hf"),
        "--to", "hf", "--verify",
    )  # fmt: skip
    said_verify = [
        line for line in (converted.stdout + converted.stderr).splitlines() if "verify:" in line
    ]
    return [
        (
            "ppo critic: 2 steps, then --resume to 4 (DCP)",
            ppo_ok and said and reloaded,
            f"steps {steps}, value_loss {values[0]:.3f} -> {values[-1]:.3f}, "
            f"resumed from recover/step-2: {said and reloaded}",
        ),
        (
            "convert-checkpoint recover/step-4 -> hf --verify",
            bool(said_verify) and (work / "hf" / "config.json").is_file(),
            f"{time.perf_counter() - start:.1f}s; "
            + (said_verify[0].removeprefix("verify: ")[:110] if said_verify else "no verdict"),
        ),
    ]


def check_supervised(work: Path, device: str) -> list[Row]:
    """SFT and the reward model, 4 steps each, with their held-out metrics."""
    runs = recipe_runs(work, device)
    _areal(work, "train", *runs["sft"])
    _areal(work, "train", *runs["rm"])
    (sft_dir,) = (work / "runs").glob("*/sft")
    (rm_dir,) = (work / "runs").glob("*/rm")
    sft, rm = _rows(sft_dir), _rows(rm_dir)
    before, after = sft[0]["eval_loss_initial"], sft[-1]["eval_loss"]
    accuracy = rm[-1]["eval_accuracy"]
    return [
        (
            "sft: 4 steps",
            len(sft) == 4 and math.isfinite(after) and after < before,
            f"held-out loss {before:.3f} -> {after:.3f}",
        ),
        (
            "reward model: 4 steps",
            len(rm) == 4 and all(math.isfinite(r["loss"]) for r in rm),
            f"loss {rm[0]['loss']:.3f} -> {rm[-1]['loss']:.3f}, held-out accuracy {accuracy:.3f}",
        ),
    ]


def check_eval(work: Path, device: str) -> list[Row]:
    """areal eval of the demo's initial model on the device (50 prompts, 4 samples)."""
    out = work / "eval"
    _areal(work, "eval", *recipe_runs(work, device)["eval"], "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    return [
        (
            "areal eval: builtin:tiny-arith",
            summary["n_samples"] == 200 and 0.1 < summary["accuracy"] < 0.6,
            f"accuracy {summary['accuracy']:.3f} over {summary['n_samples']} samples "
            f"(about 0.32 on the CPU), {summary['elapsed_s']:.1f}s",
        )
    ]


def check_serve(work: Path, device: str) -> list[Row]:
    """areal serve of builtin:tiny-arith (it takes the GPU when there is one): one
    /generate with logprobs, against a teacher-forced transformers forward pass."""
    import signal
    import urllib.request

    import torch
    from transformers import AutoModelForCausalLM

    from areal_cli.launch.builtins import cached
    from areal_cli.launch.ports import free_port

    port = free_port()
    log = work / "serve.log"
    argv = [sys.executable, "-m", "areal_cli.cli", "serve", "builtin:tiny-arith"]
    argv += ["--port", str(port), "--log", str(log)]
    server = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    info: dict = {}
    url = f"http://127.0.0.1:{port}"

    def call(path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    try:
        deadline = time.time() + 300
        while True:
            try:
                info = call("/server_info")
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    why = server.stderr.read().decode()[-2000:]
                    raise RuntimeError(f"areal serve did not start: {why}") from None
                time.sleep(0.5)
        prompt = [1, 30, 31, 32]
        answer = call(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {
                    "temperature": 1.0,
                    "max_new_tokens": 16,
                    "ignore_eos": True,
                    "sampling_seed": 3,
                },
                "return_logprob": True,
            },
        )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    ids = answer["output_ids"]
    hf = AutoModelForCausalLM.from_pretrained(cached("tiny-arith", 1)).to(device).eval()
    with torch.no_grad():
        whole = torch.tensor([prompt + ids], device=device)
        logits = hf(whole).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, whole[0, len(prompt) :, None])[:, 0]
    worst = float((torch.tensor(got, device=device) - expected).abs().max())
    on = info["device"]
    return [
        (
            "areal serve: /generate logprobs vs transformers",
            on.startswith(device) and worst < 1e-3 and len(ids) == 16,
            f"served on {on}, {len(ids)} tokens, max |d| {worst:.1e} (bound 1e-3)",
        )
    ]


def check_memory(work: Path, device: str) -> list[Row]:
    """The embedded engine's release_memory_occupation and resume on the device: what it
    holds falls by at least its weights and KV cache, and comes back; a seeded request
    gives the same tokens before and after. On a GPU what it holds is
    torch.cuda.memory_allocated; on the CPU, the bytes of the model's tensors."""
    import torch

    from areal_cli.inference.api import GenerateRequest, SamplingParams
    from areal_cli.inference.engine import InferenceEngine
    from areal_cli.launch.builtins import cached

    def held(engine: InferenceEngine) -> int:
        if device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        tensors = [*engine.model.parameters(), *engine.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors) + engine.stats().kv_cache_bytes

    request = GenerateRequest(
        input_ids=[10, 11, 12, 13],
        sampling_params=SamplingParams(
            temperature=1.0, max_new_tokens=32, ignore_eos=True, sampling_seed=7
        ),
    )
    with InferenceEngine(cached("small", 1), device=device) as engine:
        first = engine.generate_sync(request).output_ids
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv = engine.stats().kv_cache_bytes
        before = held(engine)
        engine.release_memory_occupation()
        released = held(engine)
        engine.resume_memory_occupation()
        again = engine.generate_sync(request).output_ids  # on the CPU: reads the weights again
        after = held(engine)
    fell, back = before - released, after >= before - 2**20
    mb = 2**20
    return [
        (
            "engine: release and resume memory",
            fell >= weights + kv and back and again == first,
            f"held {before / mb:.1f} MB -> released {released / mb:.1f} MB -> resumed "
            f"{after / mb:.1f} MB (weights {weights / mb:.1f} MB, KV {kv / mb:.1f} MB); "
            f"same tokens after: {again == first}",
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
    parser.add_argument(
        "--only", default="", help="comma-separated checks to run (default: all), e.g. ppo,serve"
    )
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
        ("ppo", lambda w: check_ppo_resume(w, device)),
        ("supervised", lambda w: check_supervised(w, device)),
        ("eval", lambda w: check_eval(w, device)),
        ("serve", lambda w: check_serve(w, device)),
        ("memory", lambda w: check_memory(w, device)),
        ("throughput", lambda w: check_throughput(w, device)),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _ in checks}
        if unknown:
            names = ", ".join(name for name, _ in checks)
            print(f"gpu_check: no check {', '.join(sorted(unknown))}; the checks: {names}")
            return 2
        checks = [(name, check) for name, check in checks if name in wanted]
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
            if args.out:  # after every check: a run cut short by a timeout keeps its rows
                from areal_cli.rundir.handoff import write_text_atomic

                args.out.mkdir(parents=True, exist_ok=True)
                write_text_atomic(args.out / "summary.txt", summary(rows, device, args.cpu) + "\n")
    table = summary(rows, device, args.cpu)
    print(table)
    return 0 if all(ok for _, ok, _, _ in rows) else 1


def summary(rows: list[tuple[str, bool, str, float]], device: str, cpu: bool) -> str:
    """The table: the environment, then one line per check."""
    width = max(len(r[0]) for r in rows)
    lines = [f"gpu_check ({'--cpu' if cpu else 'GPU'}): {environment(device)}"]
    lines += [f"{'check':<{width}}  result  seconds  figures"]
    lines += [
        f"{check:<{width}}  {'PASS' if ok else 'FAIL':<6}  {took:7.1f}  {figures}"
        for check, ok, figures, took in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

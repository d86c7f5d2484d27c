"""Usage: python scripts/bench_e2e.py [--recipe recipes/tiny_cpu.yaml] [--runs 3] [--steps N]
       [--set KEY=VALUE ...] [--compare RECIPE ...] [--bound-steps 6 (0: skip)] [--json OUT.json]

`areal train` against the plain single-process synchronous GRPO loop, on this machine, in
one invocation. Runs alternate (areal, loop, areal, loop, ...), each as its own command,
so both pay their start-up:

  (a) `areal train RECIPE` (servers, torchrun trainer, HTTP, disk handoff), with --set
      overrides and total_train_steps=N;
  (b) the loop written here (`--reference`): the recipe's model, prompts (the same
      PromptStream order), reward function, batch (batch_size x group_size), sampling
      (temperature, top_p, top_k, max_new_tokens), GRPO advantages and clipped PPO loss
      (areal_cli.trainer.losses, token-mean) and AdamW with its schedule and clipping.
      Generation is Hugging Face `generate`; training is one plain torch forward and
      backward per minibatch, on-policy (the behaviour logprobs are the old ones: no
      proximal pass). Every core goes to each phase in turn. No FSDP, no processes, no
      HTTP.

  (c) with --compare, `areal train` of each other RECIPE too (e.g. the colocated demo,
      recipes/tiny_cpu_colocated.yaml), with the same overrides, named by its file.

For each run and as the median of the runs, with the ratio of each areal run / loop:
  - seconds per step in steady state (from the end of step 1 to the end of the last);
  - time from the command's start to the first step whose 5-step rolling mean reward
    reaches 0.8 (the demo's target; '-' if never);
  - per-step phases: the loop's generate and train; areal's train (the trainer's step),
    idle (the trainer waiting for a batch) and handoff (weights written -> served).
Then the bound that overlap allows here: the loop's phases measured alone with 1 and 2
threads for --bound-steps steps (G1, T1, G2, T2). Two processes with a core each cannot
step faster than max(G1, T1); the loop pays G2 + T2; so an asynchronous run's best ratio
on this machine is max(G1, T1) / (G2 + T2).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_RECIPE = REPO / "recipes" / "tiny_cpu.yaml"
TARGET, WINDOW = 0.8, 5


# ------------------------------------------------------------------ (b) the plain loop


def reference(recipe: Path, overrides: list[str], steps: int, threads: int) -> None:
    """The single-process synchronous GRPO loop; prints one JSON line per step."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.config.loader import load_config
    from areal_cli.config.schema import torch_dtype
    from areal_cli.data.prompts import PromptStream, load_dataset_prompts
    from areal_cli.rollout.rewards import call_reward, resolve_reward
    from areal_cli.trainer.losses import compute_advantages, ppo_policy_loss
    from areal_cli.trainer.state import build_optimizer

    torch.set_num_threads(threads)
    cfg = load_config(recipe, [*overrides, f"total_train_steps={steps}"]).config
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    path = cfg.model.path
    if path.startswith("builtin:"):
        from areal_cli.launch import builtins

        path = str(builtins.cached(path, cfg.model.seed))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or path)
    prompts = load_dataset_prompts(tokenizer, cfg.dataset, lambda _line: None)
    stream = PromptStream.from_config(prompts, cfg.dataset)
    reward_fn = resolve_reward(cfg.reward.fn, recipe.parent)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg.model.dtype))
    optimizer, scheduler = build_optimizer(model, cfg)
    a, r, g = cfg.actor, cfg.rollout, cfg.gconfig
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    for step in range(steps):
        t0 = time.perf_counter()
        batch = [p for p in stream.next_batch(r.batch_size) for _ in range(r.group_size)]
        width = max(len(p.input_ids) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p.input_ids)) + p.input_ids for p in batch])
        attn = torch.tensor(
            [[0] * (width - len(p.input_ids)) + [1] * len(p.input_ids) for p in batch]
        )
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=g.temperature,
                top_p=g.top_p, top_k=g.top_k if g.top_k > 0 else None,
                max_new_tokens=g.max_new_tokens, pad_token_id=pad,
                eos_token_id=None if g.ignore_eos else eos,
                return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
        new = out.sequences[:, width:]
        behav = (
            torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], dim=1)
            .gather(-1, new.unsqueeze(-1))
            .squeeze(-1)
        )
        completions, rewards = [], []
        for k, p in enumerate(batch):
            tokens = new[k].tolist()
            if not g.ignore_eos and eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            completions.append(tokens)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            rewards.append(call_reward(reward_fn, text, p.answer, p.row))
        gen_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        model.train()
        rewards_t = torch.tensor(rewards)
        advantages = compute_advantages(
            rewards_t, r.group_size, a.adv_estimator, a.reward_scaling, a.reward_bias
        )
        order = list(range(len(batch)))
        per = len(order) // a.ppo_n_minibatches
        for m in range(a.ppo_n_minibatches):
            rows = order[m * per : (m + 1) * per]
            full = [batch[k].input_ids + completions[k] for k in rows]
            length = max(len(x) for x in full)
            x = torch.tensor([f + [pad] * (length - len(f)) for f in full])
            mask = torch.zeros(len(rows), length - 1)
            old = torch.zeros(len(rows), length - 1)
            for i, k in enumerate(rows):
                start, n = len(batch[k].input_ids) - 1, len(completions[k])
                mask[i, start : start + n] = 1
                old[i, start : start + n] = behav[k, :n]
            keep = torch.tensor([[1] * len(f) + [0] * (length - len(f)) for f in full])
            logits = model(input_ids=x, attention_mask=keep).logits[:, :-1].float()
            logp = torch.log_softmax(logits / g.temperature, -1)
            logp = logp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
            adv = advantages[rows].unsqueeze(1).expand_as(mask)
            loss, _ = ppo_policy_loss(logp, old, adv, mask, a.eps_clip, a.eps_clip_higher)
            (loss.sum() / mask.sum().clamp(min=1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.optimizer.gradient_clipping)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t1
        line = {"step": step, "reward": sum(rewards) / len(rewards), "time": time.time()}
        print(json.dumps(line | {"generate_s": gen_s, "train_s": train_s}), flush=True)


# ------------------------------------------------------------------ the runs


def run_reference(recipe: Path, overrides: list[str], steps: int, threads: int) -> dict:
    argv = [sys.executable, __file__, "--reference", "--recipe", str(recipe), "--steps", str(steps)]
    argv += ["--threads", str(threads)] + [f"--set={o}" for o in overrides]
    start = time.time()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the reference loop failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    return summarize(rows, start, {"generate": "generate_s", "train": "train_s"})


def run_areal(recipe: Path, overrides: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as root:
        argv = [sys.executable, "-m", "areal_cli.cli", "train", str(recipe), *overrides]
        argv += [f"cluster.fileroot={root}", f"total_train_steps={steps}", "logging.display=plain"]
        start = time.time()
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"areal train failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        (metrics,) = Path(root).glob("*/*/metrics.jsonl")
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x]
    for row in rows:
        row["reward"] = row["reward_mean"]
    phases = {"train": "trainer_step_s", "idle": "trainer_wait_s", "handoff": "handoff_latency_s"}
    return summarize(rows, start, phases)


def summarize(rows: list[dict], start: float, phases: dict[str, str]) -> dict:
    times = [row["time"] for row in rows]
    rewards = [row["reward"] for row in rows]
    to_reward = None
    for i in range(WINDOW - 1, len(rewards)):
        if statistics.fmean(rewards[i - WINDOW + 1 : i + 1]) >= TARGET:
            to_reward = times[i] - start
            break
    steady = rows[1:]  # the first step carries warm-up (first forward passes, allocations)
    return {
        "step_s": (times[-1] - times[0]) / max(1, len(times) - 1),
        "to_reward_s": to_reward,
        "last5": statistics.fmean(rewards[-WINDOW:]),
        "wall_s": times[-1] - start,
        "phases": {
            name: statistics.median(row[key] for row in steady if key in row)
            for name, key in phases.items()
        },
    }


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--compare", action="append", default=[], type=Path, metavar="RECIPE")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, help="default: the recipe's total_train_steps")
    parser.add_argument("--bound-steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="(b)'s threads")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bound_steps == 1 or (args.steps is not None and args.steps < 2):
        parser.error(
            "--steps and --bound-steps take at least 2 (the first step is warm-up); --bound-steps 0 skips the bound"
        )
    if args.reference:
        reference(args.recipe, args.overrides, args.steps, args.threads)
        return 0
    from areal_cli.config.loader import load_config

    steps = args.steps or load_config(args.recipe, args.overrides).config.total_train_steps
    print(f"{args.recipe} {' '.join(args.overrides)}: {steps} steps, {args.runs} runs each")
    recipes = {"areal": args.recipe, "loop": args.recipe}
    recipes |= {path.stem: path for path in args.compare}
    results: dict[str, list[dict]] = {name: [] for name in recipes}
    for i in range(args.runs):
        for name, recipe in recipes.items():
            if name == "loop":
                res = run_reference(recipe, args.overrides, steps, args.threads)
            else:
                res = run_areal(recipe, args.overrides, steps)
            results[name].append(res)
            phases = "  ".join(f"{k} {v:.3f}s" for k, v in res["phases"].items())
            print(
                f"run {i + 1} {name:<5}  step {res['step_s']:.3f}s  to reward "
                f"{_fmt(res['to_reward_s'])}  last-5 {res['last5']:.3f}  wall "
                f"{res['wall_s']:.1f}s  | {phases}",
                flush=True,
            )
    med = {
        name: {
            "step_s": statistics.median(r["step_s"] for r in rs),
            "to_reward_s": (
                statistics.median(reached)
                if (reached := [r["to_reward_s"] for r in rs if r["to_reward_s"] is not None])
                else None  # no run reached it
            ),
        }
        for name, rs in results.items()
    }
    loop = med["loop"]
    for name in (n for n in recipes if n != "loop"):
        print(
            f"median  seconds per step: {name} {med[name]['step_s']:.3f}  loop "
            f"{loop['step_s']:.3f}  ratio {_ratio(med[name]['step_s'], loop['step_s'])}"
        )
        print(
            f"median  time to a 5-step reward of {TARGET}: {name} "
            f"{_fmt(med[name]['to_reward_s'])}  loop {_fmt(loop['to_reward_s'])}  ratio "
            f"{_ratio(med[name]['to_reward_s'], loop['to_reward_s'])}"
        )
    bound = {}
    for threads in (1, 2) if args.bound_steps else ():
        res = run_reference(args.recipe, args.overrides, args.bound_steps, threads)
        bound[threads] = res["phases"]
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "median": med, "bound": bound}, indent=1))
    if not bound:
        return 0
    g1, t1 = bound[1]["generate"], bound[1]["train"]
    g2, t2 = bound[2]["generate"], bound[2]["train"]
    print(
        f"bound   alone: generate {g1:.3f}s (1 thread) {g2:.3f}s (2)  train {t1:.3f}s (1) "
        f"{t2:.3f}s (2); best async step max(G1,T1) {max(g1, t1):.3f}s vs sync G2+T2 "
        f"{g2 + t2:.3f}s: ratio >= {max(g1, t1) / (g2 + t2):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

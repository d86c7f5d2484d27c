"""The builtin `tiny-arith` model: `builtin:tiny` after supervised fine-tuning on
single-digit addition, the starting point of the CPU demo (recipes/tiny_cpu.yaml), so
that GRPO has a signal to use.

A randomly initialised model never writes "number then EOS", so every sample would score 0
and RL would have nothing to learn from. The product makes this model with its own SFT
role: `build_arith_demo_model` writes the addition data (the same rows as recipes/data,
from `arith_rows`) and the packaged recipe `tiny_arith_sft.yaml` into a temporary folder,
runs `areal train` on it (one FSDP2 rank under torchrun, no inference server), and keeps
the final checkpoint. recipes/tiny_sft.yaml runs the same recipe by hand.

The recipe trains on prompts rendered with the tokenizer's chat template (exactly as the
rollout formats dataset rows) with the answer tokens and EOS as targets, under label
smoothing restricted to the answer alphabet (`sft.smoothing_support: targets`): each
target token gets 1 - F of the mass and F is spread evenly over the ten digits and EOS.
The model therefore learns the format and puts the most mass on the correct sum (greedy
decoding is right), but a sample at temperature 1.0 is right only ~28% of the time
(F = 0.45): it sometimes writes a wrong digit, stops early, or runs on ("312"). RL then
has to sharpen that distribution, which it does within the demo's few minutes.

The task space is only the 100 problems a+b with a, b in 0..9, so the warm-up sees the
same problems as the RL run and its evaluation (the train and test files differ only in
how often they repeat each problem); what the warm-up withholds is confidence, not problems.

Deterministic for a given seed on a given number of cores (the recipe gives the trainer
2). The folder is written atomically (a temporary folder in the same parent, then a
rename) and holds the model, the tokenizer (with its chat template), the SFT run's
metrics (sft_metrics.jsonl) and demo_model.json recording how it was made and its
accuracy. Takes ~30 s on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, RunDir

# Grades a completion against the reference answer (the recipe's reward, builtin:numeric,
# given by the caller: models sit below rollout and do not import its rewards).
Score = Callable[[str, str], float]

INFO_FILE = "demo_model.json"
SFT_RECIPE = Path(__file__).with_name("tiny_arith_sft.yaml")
MAX_SUM = 18  # largest answer of the task (9+9)
DATA_FILES = (("arith_train.jsonl", 2000), ("arith_test.jsonl", 200))


def arith_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """`n` random problems {"prompt": "What is 3+5?", "answer": "8"} (a, b in 0..9)."""
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"prompt": f"What is {a}+{b}?", "answer": str(a + b)})
    return rows


def write_arith_data(out_dir: Path, seed: int = 0) -> list[Path]:
    """The train and test files of the task (recipes/data holds these for seed 0), each
    written to a temp file and renamed into place."""
    return _write_files(out_dir, DATA_FILES, arith_rows, random.Random(seed))


def _write_files(out_dir: Path, files, make_rows, rng: random.Random) -> list[Path]:
    """Each (name, n) of `files` as OUT_DIR/name: n rows of make_rows(rng, n), written to a
    temp file and renamed into place."""
    paths = []
    for name, n in files:
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in make_rows(rng, n)))
        tmp.replace(out_dir / name)
        paths.append(out_dir / name)
    return paths


PREFERENCE_FILES = (("arith_pref_train.jsonl", 2000), ("arith_pref_test.jsonl", 200))


def preference_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """`n` preference pairs for reward-model training: {"prompt": "What is 3+5?",
    "chosen": "8", "rejected": "7"}. The rejected answer is wrong: half the time off by one
    or two (the near misses a policy makes), else any other sum of the task."""
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        right = a + b
        if rng.random() < 0.5:
            wrong = right + rng.choice([d for d in (-2, -1, 1, 2) if right + d >= 0])
        else:
            wrong = rng.choice([v for v in range(MAX_SUM + 1) if v != right])
        rows.append({"prompt": f"What is {a}+{b}?", "chosen": str(right), "rejected": str(wrong)})
    return rows


def write_preference_data(out_dir: Path, seed: int = 0) -> list[Path]:
    """The train and test preference files (recipes/data holds these for seed 0)."""
    return _write_files(out_dir, PREFERENCE_FILES, preference_rows, random.Random(seed + 1))


def problems() -> list[tuple[int, int]]:
    """The whole task space: every (a, b) with single digits."""
    return [(a, b) for a in range(10) for b in range(10)]


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    """The chat-formatted prompt of a+b, as the rollout renders a dataset row with the
    chat template and no system prompt (tests/inference/test_tiny_model.py checks that)."""
    messages = [{"role": "user", "content": f"What is {a}+{b}?"}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def answer_ids(tokenizer, value: int) -> list[int]:
    """The completion the model should write: the number's tokens, then EOS."""
    return [*tokenizer.encode(str(value), add_special_tokens=False), tokenizer.eos_token_id]


def make_batch(
    tokenizer,
    prompts: dict[tuple[int, int], list[int]],
    pairs: list[tuple[int, int]],
    labels: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and next-token targets (-100 off the answer)."""
    rows, targets = [], []
    for pair, label in zip(pairs, labels, strict=True):
        prompt = prompts[pair]
        answer = answer_ids(tokenizer, label)
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    tgt = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
    return ids, mask, tgt


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> list[str]:
    """Decode each prompt (all the same length here) without a KV cache; temperature 0 is
    greedy. Returns the completions as text, special tokens dropped."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts must have the same length")
    ids = torch.tensor(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids).logits[:, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(tok)
        done |= nxt == tokenizer.eos_token_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]


@torch.no_grad()
def exact_probability(model, tokenizer) -> float:
    """Mean over the 100 problems of p(correct sum then EOS | prompt) at temperature 1:
    the expected reward of a sample that keeps the format (a lower bound on it)."""
    pairs = problems()
    prompts = {p: prompt_ids(tokenizer, *p) for p in pairs}
    ids, mask, tgt = make_batch(tokenizer, prompts, pairs, [a + b for a, b in pairs])
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    t = tgt[:, 1:]
    tok = logp[:, :-1].gather(-1, t.clamp(min=0)[..., None])[..., 0]
    seq = torch.where(t >= 0, tok, torch.zeros_like(tok)).sum(-1)
    return float(seq.exp().mean())


def evaluate(
    model, tokenizer, score: Score, n_samples: int, max_new_tokens: int, seed: int
) -> dict:
    """Greedy and temperature-1 accuracy (graded by `score`) over all 100 problems."""
    generator = torch.Generator().manual_seed(seed)
    pairs = problems()
    prompts = [prompt_ids(tokenizer, *p) for p in pairs]
    answers = [str(a + b) for a, b in pairs]
    greedy = sample(model, tokenizer, prompts, max_new_tokens, 0.0, generator)
    sampled = sample(model, tokenizer, prompts * n_samples, max_new_tokens, 1.0, generator)
    greedy_acc = sum(score(c, a) for c, a in zip(greedy, answers, strict=True)) / len(pairs)
    sampled_acc = sum(score(c, a) for c, a in zip(sampled, answers * n_samples, strict=True)) / len(
        sampled
    )
    return {
        "greedy_accuracy": greedy_acc,
        "sampled_accuracy": sampled_acc,
        "p_correct_then_eos": exact_probability(model, tokenizer),
        "sampled_examples": [
            f"{p[0]}+{p[1]} -> {c!r}" for p, c in zip(pairs[:6], sampled[:6], strict=True)
        ],
    }


def build_arith_demo_model(
    out_dir: Path,
    score: Score,
    seed: int = 1,
    overrides: tuple[str, ...] = (),
    eval_samples: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Build the model into `out_dir` atomically by running the SFT recipe (see the module
    docstring; `overrides` are extra `key=value`s for it); returns what demo_model.json
    holds."""
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        work = tmp / "sft"
        work.mkdir()
        write_arith_data(work)
        recipe = Path(shutil.copy(SFT_RECIPE, work / SFT_RECIPE.name))
        checkpoint, metrics = _run_sft(recipe, tmp / "runs", seed, overrides, progress)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        stats = evaluate(model, tokenizer, score, eval_samples, 6, seed + 1)
        held_out = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        info = {
            "base": "builtin:tiny",
            "seed": seed,
            "made_by": f"areal train {SFT_RECIPE.name} " + " ".join(overrides),
            "steps": len(metrics),
            "first_loss": metrics[0]["loss"],
            "final_loss": metrics[-1]["loss"],
            "held_out_loss": held_out,
            **stats,
        }
        # a plain HF folder: the run's entry manifest describes a checkpoint, not this model
        (checkpoint / handoff.MANIFEST).unlink()
        shutil.copy(metrics_path(checkpoint), checkpoint / "sft_metrics.jsonl")
        (checkpoint / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():  # replacing: move the old folder aside, then swap the new one in
            os.rename(out_dir, tmp / "old")
        os.rename(checkpoint, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def metrics_path(checkpoint: Path) -> Path:
    """RUN/metrics.jsonl of the run that wrote RUN/checkpoints/step-N."""
    return RunDir(checkpoint.parents[1]).metrics


def _run_sft(
    recipe: Path,
    fileroot: Path,
    seed: int,
    overrides: tuple[str, ...],
    progress: Callable[[int, int], None] | None = None,
):
    """Run `areal train RECIPE` as a child process, telling `progress` its steps (the
    lines of its metrics.jsonl) twice a second; returns its final checkpoint folder and
    its metrics. A failure raises with the tail of the run's output."""
    import time

    import yaml

    from areal_cli.rundir.process import die_with_parent

    total = int(yaml.safe_load(recipe.read_text())["total_train_steps"])
    for item in overrides:
        if item.startswith("total_train_steps="):
            total = int(item.split("=", 1)[1])
    argv = [
        sys.executable,
        "-m",
        "areal_cli.cli",
        "train",
        str(recipe),
        f"cluster.fileroot={fileroot}",
        f"seed={seed}",
        f"model.seed={seed}",
        "logging.display=plain",
        *overrides,
    ]
    run_dir = fileroot / "tiny-sft" / "trial0"
    output = fileroot.parent / "sft-output.log"
    with open(output, "wb") as log:
        child = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        try:
            while child.poll() is None:
                if progress is not None:
                    progress(_lines(RunDir(run_dir).metrics), total)
                time.sleep(0.5)
        finally:
            if child.poll() is None:  # interrupted: the run goes with its parent
                child.kill()
                child.wait()
    found = [e.path for e in handoff.list_entries(RunDir(run_dir).checkpoints, STEP_PREFIX)]
    if child.returncode != 0 or not found:
        tail = "\n".join(output.read_text(errors="replace").strip().splitlines()[-15:])
        raise RuntimeError(
            f"building builtin:tiny-arith failed: `areal train {recipe.name}` exited with "
            f"{child.returncode}; the last lines of its output:\n{tail}"
        )
    if progress is not None:
        progress(total, total)
    lines = metrics_path(found[-1]).read_text().splitlines()
    return found[-1], [json.loads(line) for line in lines if line]


def _lines(path: Path) -> int:
    """How many complete lines a file holds (0 when it is missing)."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0

"""The builtin `tiny-arith` model: `builtin:tiny` after a short supervised warm-up on
single-digit addition, the starting point of the CPU demo (recipes/tiny_cpu.yaml), so
that GRPO has a signal to use.

A randomly initialised model never writes "number then EOS", so every sample would score 0
and RL would have nothing to learn from. The warm-up trains on prompts rendered with the
tokenizer's chat template (exactly as areal_cli.data.prompts formats dataset rows) with the
answer tokens and EOS as targets, under label smoothing restricted to the answer alphabet:
each target token gets 1 - F of the mass and F is spread evenly over the ten digits and
EOS. The model therefore learns the format and puts the most mass on the correct sum
(greedy decoding is right), but a sample at temperature 1.0 is right only ~28% of the time
(F = 0.45): it sometimes writes a wrong digit, stops early, or runs on ("312"). RL then
has to sharpen that distribution, which it does within the demo's few minutes (see
scripts/tune_demo_rl.py). `correct_frac` below 1 also replaces that fraction of targets by
random numbers in 0..18 (label noise; not used by default).

The task space is only the 100 problems a+b with a, b in 0..9, so the warm-up sees the
same problems as the RL run and its evaluation (the train and test files differ only in
how often they repeat each problem); what the warm-up withholds is confidence, not problems.

Deterministic for a given seed (model init, example order, evaluation samples) on one
thread. The folder is written atomically (a temporary folder in the same parent, then a
rename) and holds the model, the tokenizer (with its chat template) and demo_model.json
recording how it was made and its accuracy. Takes ~15-40 s on one CPU thread (250 steps).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_cli.models.tiny_model import build_tiny_model

# Grades a completion against the reference answer (the recipe's reward, builtin:numeric,
# given by the caller: models sit below rollout and do not import its rewards).
Score = Callable[[str, str], float]

INFO_FILE = "demo_model.json"
MAX_SUM = 18  # largest answer of the task (9+9)


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


def answer_alphabet(tokenizer) -> list[int]:
    """The tokens an answer is written with: the ten digits and EOS."""
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    return [*digits, tokenizer.eos_token_id]


def warm_up(
    model,
    tokenizer,
    steps: int,
    batch_size: int,
    lr: float,
    smoothing: float,
    correct_frac: float,
    generator: torch.Generator,
) -> list[float]:
    """Supervised warm-up on chat examples; returns the loss per step.

    The loss covers the answer tokens and EOS only. Each target is the correct sum with
    probability `correct_frac` (else a random number in 0..MAX_SUM), and each token's
    target distribution is smoothed: 1 - `smoothing` on the target token, `smoothing`
    spread evenly over the answer alphabet (digits and EOS). Smoothing keeps the correct
    answer the most likely one while capping how often a sample at temperature 1 gets it.
    """
    pairs_all = problems()
    prompts = {p: prompt_ids(tokenizer, *p) for p in pairs_all}
    alphabet = torch.tensor(answer_alphabet(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1.0 - s / steps)
    )
    model.train()
    losses = []
    for _ in range(steps):
        index = torch.randint(len(pairs_all), (batch_size,), generator=generator).tolist()
        pairs = [pairs_all[i] for i in index]
        correct = (torch.rand(batch_size, generator=generator) < correct_frac).tolist()
        noise = torch.randint(MAX_SUM + 1, (batch_size,), generator=generator).tolist()
        labels = [a + b if ok else n for (a, b), ok, n in zip(pairs, correct, noise, strict=True)]
        ids, mask, tgt = make_batch(tokenizer, prompts, pairs, labels)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1], -1)
        target = tgt[:, 1:]
        on = target >= 0
        nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
        spread = -logp[..., alphabet].mean(-1)
        loss = ((1.0 - smoothing) * nll + smoothing * spread)[on].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


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
    steps: int = 250,
    batch_size: int = 64,
    lr: float = 3e-3,
    smoothing: float = 0.45,
    correct_frac: float = 1.0,
    eval_samples: int = 8,
) -> dict:
    """Build the warmed-up model into `out_dir` atomically; returns what demo_model.json holds."""
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        base = build_tiny_model(tmp / "base", preset="tiny", seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        losses = warm_up(
            model, tokenizer, steps, batch_size, lr, smoothing, correct_frac, generator
        )
        stats = evaluate(model, tokenizer, score, eval_samples, 6, seed + 1)
        staged = tmp / "model"
        model.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        info = {
            "base": "builtin:tiny",
            "seed": seed,
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "smoothing": smoothing,
            "correct_frac": correct_frac,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            **stats,
        }
        (staged / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():  # replacing: move the old folder aside, then swap the new one in
            os.rename(out_dir, tmp / "old")
        os.rename(staged, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info

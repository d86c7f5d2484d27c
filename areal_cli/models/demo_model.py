"""The builtin `tiny-arith` model: `builtin:tiny` after supervised fine-tuning on
single-digit addition, the starting point of the CPU demo (recipes/tiny_cpu.yaml), so
that GRPO has a signal to use.

A randomly initialised model never writes "number then EOS", so every sample would score 0
and RL would have nothing to learn from. The product makes this model with its own SFT
role: areal_cli.launch.builtins runs `areal train` on the packaged recipe
`tiny_arith_sft.yaml` and the addition data written here (the same rows as recipes/data,
from `arith_rows`), one FSDP2 rank under torchrun with no inference server, and keeps
the final checkpoint with the evaluation made here (`evaluate`). This module holds only
the model's data and its evaluation: models/ sits below the CLI and never runs it.
recipes/tiny_sft.yaml runs the same recipe by hand.

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
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: reading the cache must not need it
    import torch

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
    return write_files(out_dir, DATA_FILES, arith_rows, random.Random(seed))


def write_files(out_dir: Path, files, make_rows, rng: random.Random) -> list[Path]:
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
    return write_files(out_dir, PREFERENCE_FILES, preference_rows, random.Random(seed + 1))


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
    import torch

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
    import torch

    with torch.no_grad():
        return _sample(model, tokenizer, prompts, max_new_tokens, temperature, generator)


def _sample(model, tokenizer, prompts, max_new_tokens, temperature, generator) -> list[str]:
    import torch

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


def exact_probability(model, tokenizer) -> float:
    """Mean over the 100 problems of p(correct sum then EOS | prompt) at temperature 1:
    the expected reward of a sample that keeps the format (a lower bound on it)."""
    import torch

    pairs = problems()
    prompts = {p: prompt_ids(tokenizer, *p) for p in pairs}
    ids, mask, tgt = make_batch(tokenizer, prompts, pairs, [a + b for a, b in pairs])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits, -1)
    t = tgt[:, 1:]
    tok = logp[:, :-1].gather(-1, t.clamp(min=0)[..., None])[..., 0]
    seq = torch.where(t >= 0, tok, torch.zeros_like(tok)).sum(-1)
    return float(seq.exp().mean())


def evaluate(
    model, tokenizer, score: Score, n_samples: int, max_new_tokens: int, seed: int
) -> dict:
    """Greedy and temperature-1 accuracy (graded by `score`) over all 100 problems."""
    import torch

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

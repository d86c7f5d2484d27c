"""The DPO role's held-out eval keeps the frozen reference's logprobs from its first pass:
later evals run the policy only, and give what a full recomputation gives (the step and
the layouts run end to end in tests/e2e/test_dpo.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from areal_cli.config.schema import ExperimentConfig
from areal_cli.trainer.dpo import RefCache, _pair_pass
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.rm import load_pairs
from tests.conftest import write_jsonl


def test_later_evals_reuse_the_references_logprobs(tokenizer, tiny_model_dir: Path, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = ExperimentConfig()
    cfg.algorithm = "dpo"
    cfg.actor.mb_spec.max_tokens_per_mb = 64  # several micro-batches
    rows = [
        {"prompt": f"What is {a}+{b}?", "chosen": str(a + b), "rejected": str(a * b + 1)}
        for a in range(3)
        for b in range(4)
    ]
    pairs = load_pairs(cfg, tokenizer, write_jsonl(tmp_path / "held_out.jsonl", rows))
    policy, ref = (AutoModelForCausalLM.from_pretrained(tiny_model_dir) for _ in range(2))
    calls = []
    ref.register_forward_hook(lambda *_: calls.append(1))
    index = list(range(len(pairs)))

    def evaluate(cache: RefCache | None) -> dict[str, float]:
        with torch.no_grad():
            return _pair_pass(
                policy, ref, pairs, index, cfg, StepLayout(), lambda _: None, False, cache
            )

    cache = RefCache()
    first = evaluate(cache)
    forwards = len(calls)
    assert forwards > 1 and cache.micro_batches is not None
    assert evaluate(cache) == first and len(calls) == forwards  # the policy ran alone
    with torch.no_grad():  # a trained policy: the kept reference still scores it exactly
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    kept = evaluate(cache)
    assert len(calls) == forwards
    assert kept == evaluate(None) and kept != first
    assert len(calls) == 2 * forwards

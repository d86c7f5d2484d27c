"""The reward-model role's data and rules: which tokens each side of a pair holds, pairs
that do not fit, and the keys a reward-model recipe may not carry (the trainer's step
itself runs in tests/e2e/test_rm.py)."""

from __future__ import annotations

import pytest

from areal_cli.config.schema import ExperimentConfig
from areal_cli.data.prompts import DatasetError, chat_ids
from areal_cli.trainer.rm import load_pairs
from tests.conftest import run_areal, write_jsonl


def test_each_side_is_the_prompt_then_its_answer_and_eos(tokenizer, tmp_path) -> None:
    cfg = ExperimentConfig()
    row = {"prompt": "What is 3+4?", "chosen": "7", "rejected": 12}
    pairs = load_pairs(cfg, tokenizer, write_jsonl(tmp_path / "p.jsonl", [row]))
    prompt = chat_ids(tokenizer, [{"role": "user", "content": "What is 3+4?"}])
    eos = [tokenizer.eos_token_id]
    assert pairs.chosen == [prompt + tokenizer.encode("7", add_special_tokens=False) + eos]
    assert pairs.rejected == [prompt + tokenizer.encode("12", add_special_tokens=False) + eos]
    assert pairs.lengths([0]) == [len(pairs.chosen[0]) + len(pairs.rejected[0])]


def test_pairs_too_long_are_skipped_and_columns_are_checked(tokenizer, tmp_path) -> None:
    cfg = ExperimentConfig()
    cfg.rm.max_len = 14
    rows = [
        {"prompt": "1+1", "chosen": "2", "rejected": "3"},
        {"prompt": "What is 3+4?", "chosen": "7", "rejected": "a much longer wrong answer"},
    ]
    pairs = load_pairs(cfg, tokenizer, write_jsonl(tmp_path / "p.jsonl", rows))
    assert len(pairs) + pairs.skipped == 2 and pairs.skipped >= 1
    cfg.rm.rejected_key = "worse"
    with pytest.raises(DatasetError, match="no column 'worse'"):
        load_pairs(cfg, tokenizer, write_jsonl(tmp_path / "q.jsonl", rows))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.batch_size=4", "rollout: is not used by algorithm: rm"),
        ("sft.batch_size=4", "sft: is only read by algorithm: sft"),
        ("algorithm=grpo", "rm: is only read by algorithm: rm"),
        ("allocation_mode=fsdp:d1c2", "algorithm: rm does not support context parallelism"),
        ("allocation_mode=embedded:d1+fsdp:d1", "algorithm: rm starts no inference server"),
    ],
)  # fmt: skip
def test_keys_of_another_role_are_refused(override: str, message: str) -> None:
    result = run_areal("validate", "recipes/tiny_rm.yaml", override)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr

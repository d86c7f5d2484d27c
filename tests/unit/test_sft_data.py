"""The SFT role's data: which tokens are targets, which examples each step takes, and the
label-smoothing term (the trainer's step itself is covered in tests/gloo)."""

from __future__ import annotations

import pytest
import torch

from areal_cli.config.schema import ExperimentConfig
from areal_cli.data.prompts import DatasetError, chat_ids
from areal_cli.trainer import losses
from areal_cli.trainer.sft import load_examples, step_indices
from tests.conftest import write_jsonl


def test_targets_are_the_answer_and_eos(tokenizer, tmp_path) -> None:
    cfg = ExperimentConfig()
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 3+4?", "answer": "7"}])
    ex = load_examples(cfg, tokenizer, path)
    prompt = chat_ids(tokenizer, [{"role": "user", "content": "What is 3+4?"}])
    answer = tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ex.input_ids == [prompt + answer]
    assert ex.targets == [[0] * len(prompt) + [1] * len(answer)]
    batch = ex.batch([0, 0])
    assert batch.n_seqs == 2 and int(batch.loss_mask.sum()) == 2 * len(answer)


def test_rows_longer_than_max_len_are_counted_and_skipped(tokenizer, tmp_path) -> None:
    cfg = ExperimentConfig()
    cfg.sft.max_len = 12
    rows = [{"prompt": "What is 3+4?", "answer": "7"}, {"prompt": "1+1", "answer": "2"}]
    ex = load_examples(cfg, tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))
    assert ex.skipped + len(ex) == 2 and all(len(i) <= 12 for i in ex.input_ids)


def test_conversation_targets_are_the_assistant_turns(tokenizer, tmp_path) -> None:
    cfg = ExperimentConfig()
    cfg.sft.messages_key = "messages"
    talk = [
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    ex = load_examples(cfg, tokenizer, write_jsonl(tmp_path / "c.jsonl", [{"messages": talk}]))
    ids, targets = ex.input_ids[0], ex.targets[0]
    assert len(ids) == len(targets)
    first = chat_ids(tokenizer, talk[:1])
    second = chat_ids(tokenizer, talk[:3])
    assert targets[: len(first)] == [0] * len(first)  # the user's turn is context
    assert sum(targets[len(first) : len(second)]) > 0  # the first reply is trained
    assert ids[: len(second)] == second
    assert sum(targets[len(second) :]) == len(ids) - len(second)  # so is the last one
    decoded = tokenizer.decode([t for t, m in zip(ids, targets, strict=True) if m])
    assert "2" in decoded and "4" in decoded and "What" not in decoded


def test_tool_conversations_train_the_calls_as_the_proxy_renders_them(tokenizer, tmp_path):
    """With sft.tools_key the template renders the row's tools, a call is a target in the
    tokens the agent proxy sends, and a turn of weight 0 is context only."""
    import random

    from areal_cli.data.chat import chat_prompt_ids
    from areal_cli.models.tool_model import ADD_TOOL, tool_rows

    cfg = ExperimentConfig()
    cfg.sft.messages_key, cfg.sft.tools_key = "messages", "tools"
    rows = tool_rows(random.Random(0), 40)
    ex = load_examples(cfg, tokenizer, write_jsonl(tmp_path / "t.jsonl", rows))
    kinds = set()
    for row, ids, targets in zip(rows, ex.input_ids, ex.targets, strict=True):
        talk = row["messages"]
        # the first request of an agent episode: what the proxy renders for it
        prompt = chat_prompt_ids(tokenizer, talk[:1], [ADD_TOOL])
        assert ids[: len(prompt)] == prompt and not any(targets[: len(prompt)])
        trained = tokenizer.decode([t for t, m in zip(ids, targets, strict=True) if m])
        if len(talk) == 2:
            kinds.add("gives up")
            assert "cannot add" in trained
        elif talk[1].get("weight") == 0:
            kinds.add("answer only")
            assert "<tool_call>" not in trained and row["answer"] in trained
        else:
            kinds.add("calls")
            assert '<tool_call>{"name": "add", "arguments": {"a": ' in trained
            assert trained.rstrip().endswith(row["answer"] + "<|eos|>")
    assert kinds == {"gives up", "answer only", "calls"}


def test_a_conversation_without_reply_is_an_error(tokenizer, tmp_path) -> None:
    cfg = ExperimentConfig()
    cfg.sft.messages_key = "messages"
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DatasetError, match="row 0: the conversation has no assistant turn"):
        load_examples(cfg, tokenizer, path)


def test_steps_walk_shuffled_epochs() -> None:
    seen = [step_indices(10, 4, s, seed=3, shuffle=True) for s in range(1, 6)]
    flat = [i for s in seen for i in s]
    assert sorted(flat[:10]) == list(range(10))  # the first epoch is a permutation
    assert sorted(flat[10:20]) == list(range(10))  # so is the second
    assert flat[:10] != flat[10:20]  # each epoch its own order
    assert step_indices(10, 4, 4, seed=3, shuffle=True) == seen[3]  # a resumed step is the same
    assert step_indices(10, 4, 1, seed=3, shuffle=False) == [0, 1, 2, 3]


def test_support_mean_matches_a_plain_log_softmax() -> None:
    logits = torch.randn(5, 13)
    support = torch.tensor([1, 4, 7])
    want = torch.log_softmax(logits, -1)[:, support].mean(-1)
    assert torch.allclose(losses.support_logprob_mean(logits, support), want, atol=1e-6)
    every = torch.log_softmax(logits, -1).mean(-1)  # the whole vocabulary: no gather
    assert torch.allclose(losses.support_logprob_mean(logits, torch.arange(13)), every, atol=1e-6)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.batch_size=4", "rollout: is not used by algorithm: sft"),
        ("actor.eps_clip=0.3", "actor.eps_clip: is not used by algorithm: sft"),
        ("allocation_mode=embedded:d1+fsdp:d1", "allocation_mode: algorithm: sft starts no inference server"),
        ("algorithm=grpo", "sft: is only read by algorithm: sft"),
    ],
)  # fmt: skip
def test_keys_of_another_role_are_refused(override: str, message: str) -> None:
    from tests.conftest import run_areal

    result = run_areal("validate", "recipes/tiny_sft.yaml", override)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_demo_model_is_built_from_the_bundled_data(tmp_path) -> None:
    """builtin:tiny-arith's SFT run writes the same rows as recipes/data, and
    recipes/tiny_sft.yaml is the packaged recipe on them."""
    from areal_cli.config.loader import load_config
    from areal_cli.models.demo_model import SFT_RECIPE, write_arith_data
    from tests.conftest import REPO

    for path in write_arith_data(tmp_path):
        assert path.read_bytes() == (REPO / "recipes" / "data" / path.name).read_bytes()
    ours = load_config(REPO / "recipes" / "tiny_sft.yaml").config
    packaged = load_config(SFT_RECIPE).config
    for cfg in (ours, packaged):  # the data paths and where runs go may differ, nothing else
        cfg.dataset.path = cfg.sft.eval_path = cfg.cluster.fileroot = ""
    assert ours == packaged


def test_the_tool_recipes_questions_are_the_bundled_data() -> None:
    """recipes/data/tool_train.jsonl is tool_model.sum_rows for seed 0."""
    import json
    import random

    from areal_cli.models.tool_model import sum_rows
    from tests.conftest import REPO

    lines = (REPO / "recipes" / "data" / "tool_train.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == sum_rows(random.Random(0), 2000)

"""Prompt loading (JSONL, Parquet, Hub errors), prompt formatting, and the resumable stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_cli.config.schema import DatasetConfig
from areal_cli.data.prompts import (
    DatasetError,
    PromptStream,
    dataset_type,
    format_prompt,
    load_prompts,
    prepare_prompts,
)

ROWS = [
    {"question": "What is 2+2?", "answer": "4", "level": 1},
    {"question": "What is 3+5?", "answer": "8", "level": 2},
    {"question": "What is 9+9?", "answer": "18", "level": 3},
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
WORDS = ["<unk>", "<s>", "</s>", "system", "user", "assistant", ":", "What", "is", "Be", "brief."]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A whitespace word-level tokenizer: every word is one token (unknown words are <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = chat_template
    return tok


def config(path: Path | str = "", **kw: Any) -> DatasetConfig:
    return DatasetConfig(path=str(path), prompt_key="question", answer_key="answer", **kw)


# --------------------------------------------------------------------------- loading


def test_load_jsonl_and_parquet_agree(tmp_path: Path) -> None:
    from_jsonl = load_prompts(config(write_jsonl(tmp_path / "d.jsonl", ROWS)))
    from_parquet = load_prompts(config(write_parquet(tmp_path / "d.parquet", ROWS)))
    assert from_jsonl == ROWS
    assert from_parquet == ROWS


def test_explicit_type_overrides_extension(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "prompts.txt", ROWS)
    assert dataset_type(config(path)) == "hub"  # unknown extension: a Hub name
    assert load_prompts(config(path, type="jsonl")) == ROWS


def test_missing_column_names_column_and_alternatives(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DatasetConfig(path=str(path), prompt_key="prompt", answer_key="answer")
    with pytest.raises(DatasetError, match=r"no column 'prompt' \(dataset.prompt_key\).*question"):
        load_prompts(cfg)
    cfg = DatasetConfig(path=str(path), prompt_key="question", answer_key="solution")
    with pytest.raises(DatasetError, match=r"no column 'solution'.*answer, level"):
        load_prompts(cfg)


def test_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        load_prompts(config(tmp_path / "absent.jsonl"))
    with pytest.raises(DatasetError, match="empty"):
        load_prompts(config(""))


@pytest.mark.slow
def test_missing_hub_dataset_fails_fast_offline(tmp_path: Path) -> None:
    # A fresh interpreter: datasets reads the offline switches when it is first imported.
    code = (
        "from areal_cli.config.schema import DatasetConfig\n"
        "from areal_cli.data.prompts import DatasetError, load_prompts\n"
        "try:\n"
        "    load_prompts(DatasetConfig(path='nobody/no-such-dataset', type='hub'))\n"
        "except DatasetError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),  # an empty cache
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "ERROR cannot load Hub dataset 'nobody/no-such-dataset'" in done.stdout
    assert "hf download" in done.stdout


# --------------------------------------------------------------------------- formatting


def test_chat_template_with_and_without_system_prompt() -> None:
    tok = make_tokenizer()
    ids = format_prompt(tok, {"question": "What is 2+2?"}, config())
    # user : What is <unk> </s> assistant :
    assert ids == [4, 6, 7, 8, 0, 2, 5, 6]
    ids = format_prompt(tok, {"question": "What is 2+2?"}, config(system_prompt="Be brief."))
    assert ids == [3, 6, 9, 10, 2, 4, 6, 7, 8, 0, 2, 5, 6]


def test_message_list_prompt() -> None:
    messages = [{"role": "system", "content": "Be"}, {"role": "user", "content": "What"}]
    ids = format_prompt(make_tokenizer(), {"question": messages}, config(system_prompt="ignored"))
    assert ids == [3, 6, 9, 2, 4, 6, 7, 2, 5, 6]  # the row's own system turn is kept


def test_plain_tokenization() -> None:
    tok = make_tokenizer(chat_template=None)
    cfg = config(apply_chat_template=False)
    assert format_prompt(tok, {"question": "What is"}, cfg) == [7, 8]
    cfg = config(apply_chat_template=False, system_prompt="Be brief.")
    assert format_prompt(tok, {"question": "What is"}, cfg) == [9, 10, 7, 8]


def test_missing_chat_template_is_a_clear_error() -> None:
    with pytest.raises(DatasetError, match="apply_chat_template: false"):
        format_prompt(make_tokenizer(chat_template=None), {"question": "What"}, config())


def test_long_prompts_are_skipped_and_counted() -> None:
    rows = [{"question": "What", "answer": 1}, {"question": "What is is is", "answer": "2"}]
    cfg = config(max_prompt_len=7)  # chat overhead is 6 tokens: one word fits, four do not
    assert format_prompt(make_tokenizer(), rows[1], cfg) is None
    prompts, bad = prepare_prompts(make_tokenizer(), rows, cfg)
    assert bad.kinds == {"a prompt over max_prompt_len=7 tokens": [1]}
    assert [(p.index, p.answer, p.input_ids) for p in prompts] == [(0, "1", [4, 6, 7, 2, 5, 6])]
    assert prompts[0].row == rows[0]


# --------------------------------------------------------------------------- streaming


def test_resume_continues_exactly() -> None:
    items = list(range(10))
    straight = PromptStream(items, seed=3)
    expected = [straight.next_batch(4) for _ in range(7)]  # 28 items: crosses two epochs

    first = PromptStream(items, seed=3)
    got = [first.next_batch(4) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    resumed = PromptStream(items, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(4) for _ in range(4)]
    assert got == expected
    assert (
        resumed.state_dict()
        == straight.state_dict()
        == {
            "epoch": 2,
            "position": 8,
            "num_items": 10,
        }
    )


def test_epochs_are_seeded_permutations() -> None:
    items = list(range(20))
    stream = PromptStream(items, seed=5)
    epoch0, epoch1 = stream.next_batch(20), stream.next_batch(20)
    assert sorted(epoch0) == sorted(epoch1) == items
    assert epoch0 != epoch1  # reshuffled with seed + epoch
    assert PromptStream(items, seed=5).next_batch(20) == epoch0
    assert PromptStream(items, seed=6).next_batch(20) == epoch1  # seed 6 epoch 0 == seed 5 epoch 1
    assert PromptStream(items, seed=5, shuffle=False).next_batch(25) == items + items[:5]


def test_stream_from_config_and_iteration() -> None:
    stream = PromptStream.from_config(["a", "b", "c"], config(shuffle=False))
    assert [next(stream) for _ in range(4)] == ["a", "b", "c", "a"]
    assert stream.epoch == 1 and len(stream) == 3


def test_stream_rejects_bad_use() -> None:
    with pytest.raises(DatasetError, match="empty"):
        PromptStream([])
    stream = PromptStream([1, 2, 3])
    with pytest.raises(ValueError):
        stream.next_batch(0)
    with pytest.raises(DatasetError, match="now has 3"):
        stream.load_state_dict({"epoch": 0, "position": 1, "num_items": 4})
    with pytest.raises(ValueError):
        stream.load_state_dict({"epoch": 0, "position": 5, "num_items": 3})

"""Bad dataset rows: each kind is counted with its row numbers, skipped with one warning
line per kind, or (on_bad_row: error) one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_cli.config.schema import DatasetConfig
from areal_cli.data.prompts import DatasetError, load_dataset_prompts, prepare_prompts, read_rows
from tests.unit.test_data import make_tokenizer, write_parquet

GOOD = {"question": "What is", "answer": "4"}

# (line of the file, why it is bad or None); the line numbers below are 1-based
LINES = [
    (json.dumps(GOOD).encode(), None),  # 1
    (b'{"question": "What is", "answer": "\xff\xfe"}', "invalid UTF-8"),  # 2
    (b'{"question": "What is", "answer": ', "invalid JSON"),  # 3
    (b'["What is", "4"]', "invalid JSON"),  # 4: not an object of columns
    (json.dumps({"answer": "4"}).encode(), "no 'question'"),  # 5
    (json.dumps({"question": None, "answer": "4"}).encode(), "no 'question'"),  # 6
    (json.dumps({"question": 7, "answer": "4"}).encode(), "a 'question' that is not"),  # 7
    (json.dumps({"question": "What is"}).encode(), "no 'answer'"),  # 8
    (json.dumps({"question": "What is", "answer": {"x": 1}}).encode(), "an 'answer' that"),  # 9
    (json.dumps({"question": "What is", "answer": True}).encode(), "an 'answer' that"),  # 10
    (b"", None),  # 11: blank lines are not rows
    (json.dumps({"question": "What is is is", "answer": 8}).encode(), "max_prompt_len"),  # 12
    (json.dumps({"question": "What", "answer": 2.5}).encode(), None),  # 13
]


def config(path: Path, **kw) -> DatasetConfig:
    kw.setdefault("max_prompt_len", 8)  # the chat template's 6 tokens and two words
    return DatasetConfig(path=str(path), prompt_key="question", answer_key="answer", **kw)


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_every_kind_is_counted_with_its_line(tmp_path: Path) -> None:
    cfg = config(write_lines(tmp_path / "d.jsonl", [line for line, _ in LINES]))
    prompts, bad = prepare_prompts(make_tokenizer(), read_rows(cfg), cfg)
    assert [p.answer for p in prompts] == ["4", "2.5"]
    expected: dict[str, list[int]] = {}
    for n, (_, why) in enumerate(LINES, 1):
        if why is not None:
            kind = next(k for k in bad.kinds if why in k)
            expected.setdefault(kind, []).append(n)
    assert bad.kinds == expected
    assert len(bad.kinds) == 7 and len(bad) == 10
    warnings = bad.warnings()
    assert len(warnings) == len(bad.kinds)  # one line per kind
    assert f"{cfg.path}: skipped 2 rows with invalid JSON (lines 3, 4)" in warnings
    assert f"{cfg.path}: skipped 1 row with invalid UTF-8 (line 2)" in warnings


def test_error_mode_stops_with_one_line(tmp_path: Path) -> None:
    cfg = config(write_lines(tmp_path / "d.jsonl", [line for line, _ in LINES]), on_bad_row="error")
    with pytest.raises(DatasetError) as caught:
        load_dataset_prompts(make_tokenizer(), cfg, warn=pytest.fail)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{cfg.path} has 10 bad rows: ")
    assert "invalid UTF-8 at line 2" in message
    assert message.endswith("fix them, or set dataset.on_bad_row: skip to skip them")


def test_skip_mode_warns_once_per_kind_and_names_the_first_rows(tmp_path: Path) -> None:
    lines = [json.dumps(GOOD).encode()] + [b"not json"] * 8
    cfg = config(write_lines(tmp_path / "d.jsonl", lines))
    said: list[str] = []
    prompts = load_dataset_prompts(make_tokenizer(), cfg, said.append)
    assert len(prompts) == 1
    assert said == [
        f"{cfg.path}: skipped 8 rows with invalid JSON (lines 2, 3, 4, 5, 6 and 3 more)"
    ]


def test_a_file_of_bad_rows_leaves_no_prompt(tmp_path: Path) -> None:
    cfg = config(write_lines(tmp_path / "d.jsonl", [b'{"question": 3, "answer": "1"}']))
    with pytest.raises(
        DatasetError, match="has no usable prompt .*skipped 1 row with a 'question'"
    ):
        load_dataset_prompts(make_tokenizer(), cfg, warn=lambda _: None)
    cfg = config(write_lines(tmp_path / "e.jsonl", [b"\xff"]))
    with pytest.raises(DatasetError, match="has no rows that can be read .*invalid UTF-8 .line 1"):
        read_rows(cfg)


def test_parquet_rows_are_numbered_from_zero(tmp_path: Path) -> None:
    rows = [GOOD, {"question": None, "answer": "1"}, {"question": "What", "answer": None}]
    cfg = config(write_parquet(tmp_path / "d.parquet", rows))
    prompts, bad = prepare_prompts(make_tokenizer(), read_rows(cfg), cfg)
    assert len(prompts) == 1
    assert bad.kinds == {"no 'question'": [1], "no 'answer'": [2]}
    assert bad.warnings()[0].endswith("(row 1)")


def test_a_json_array_file_and_message_prompts(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "What is"}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, {"question": messages, "answer": "1"}, 5]))
    cfg = config(path, max_prompt_len=64)
    prompts, bad = prepare_prompts(make_tokenizer(), read_rows(cfg), cfg)
    assert len(prompts) == 2 and bad.kinds == {"invalid JSON": [2]}
    plain = config(path, max_prompt_len=64, apply_chat_template=False)
    prompts, bad = prepare_prompts(make_tokenizer(chat_template=None), read_rows(plain), plain)
    assert len(prompts) == 1
    assert bad.kinds == {"invalid JSON": [2], "a 'question' that is not text": [1]}

"""Prompt datasets: loading rows, turning them into prompt token ids, and a resumable stream.

``read_rows`` reads JSONL line by line (Parquet and cached Hub datasets with the ``datasets``
library) and checks the configured columns. ``format_prompt`` applies the chat template (or
plain tokenization) and ``prepare_prompts`` keeps the usable rows. ``PromptStream`` hands out
batches in a per-epoch shuffled order that a checkpoint can resume exactly.

Bad rows (a JSONL line that is not UTF-8 or not a JSON object, a missing prompt or answer,
one of the wrong type, a prompt over ``max_prompt_len``) are collected by kind in
``BadRows``; ``dataset.on_bad_row`` then skips them with one warning line per kind, or stops
the run with one error line. The controller settles them before any process starts.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from areal_cli.config.schema import DatasetConfig

T = TypeVar("T")

_FILE_TYPES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_BUILDERS = {"jsonl": "json", "parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset that cannot be read or lacks the configured columns."""


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

SHOWN_ROWS = 5  # row numbers a bad-row message names per kind


class BadRows:
    """The rows of a dataset that cannot be used, by kind, with their numbers (JSONL: the
    1-based line; Parquet and Hub: the 0-based row). `key` is the recipe section whose
    `on_bad_row` decides (dataset or eval.dataset)."""

    def __init__(self, source: str, unit: str, key: str = "dataset") -> None:
        self.source, self.unit, self.key = source, unit, key
        self.kinds: dict[str, list[int]] = {}

    def add(self, kind: str, number: int) -> None:
        self.kinds.setdefault(kind, []).append(number)

    def __len__(self) -> int:
        return sum(len(numbers) for numbers in self.kinds.values())

    def _where(self, numbers: list[int]) -> str:
        shown = ", ".join(str(n) for n in numbers[:SHOWN_ROWS])
        more = f" and {len(numbers) - SHOWN_ROWS} more" if len(numbers) > SHOWN_ROWS else ""
        return f"{self.unit}{'s' if len(numbers) > 1 else ''} {shown}{more}"

    def warnings(self) -> list[str]:
        """One line per kind: how many rows were skipped and the first few numbers."""
        return [
            f"{self.source}: skipped {len(numbers)} row{'s' if len(numbers) > 1 else ''} "
            f"with {kind} ({self._where(numbers)})"
            for kind, numbers in self.kinds.items()
        ]

    def problem(self) -> str:
        """The one-line error of `on_bad_row: error`."""
        kinds = "; ".join(f"{kind} at {self._where(n)}" for kind, n in self.kinds.items())
        return (
            f"{self.source} has {len(self)} bad row{'s' if len(self) > 1 else ''}: {kinds}; "
            f"fix them, or set {self.key}.on_bad_row: skip to skip them"
        )

    def settle(self, on_bad_row: str, warn: Callable[[str], None]) -> None:
        """Raise DatasetError under `error` when there is a bad row; else warn once per kind."""
        if not len(self):
            return
        if on_bad_row == "error":
            raise DatasetError(self.problem())
        for line in self.warnings():
            warn(line)


@dataclass
class Rows:
    """A dataset's readable rows, their numbers, and the rows that could not be read."""

    rows: list[dict[str, Any]]
    numbers: list[int]
    bad: BadRows


def dataset_type(cfg: DatasetConfig) -> str:
    """jsonl, parquet or hub: ``cfg.type``, or guessed from the path when it is auto."""
    if cfg.type != "auto":
        return cfg.type
    return _FILE_TYPES.get(Path(cfg.path).suffix.lower(), "hub")


def read_rows(cfg: DatasetConfig, key: str = "dataset", check_columns: bool = True) -> Rows:
    """Every row of the dataset. A file that cannot be used, or (with `check_columns`) a
    prompt or answer column that no row has, raises DatasetError; a JSONL line that is not
    UTF-8 or not a JSON object goes to `Rows.bad`."""
    if not cfg.path:
        raise DatasetError(f"{key}.path is empty")
    kind = dataset_type(cfg)
    if kind == "jsonl":
        out = _read_jsonl(cfg.path, key)
    else:
        dataset = _load_hub(cfg) if kind == "hub" else _load_file(cfg.path, kind)
        rows = dataset.to_list()
        out = Rows(rows, list(range(len(rows))), BadRows(cfg.path, "row", key))
    if not out.rows:
        raise DatasetError(f"dataset {cfg.path} has no rows" + _unreadable(out.bad))
    if check_columns:
        columns: set[str] = set()
        for row in out.rows:
            columns.update(row)
        _check_columns(sorted(columns), cfg)
    return out


def _unreadable(bad: BadRows) -> str:
    return f" that can be read ({'; '.join(bad.warnings())})" if len(bad) else ""


def load_prompts(
    cfg: DatasetConfig, warn: Callable[[str], None] | None = None, key: str = "dataset"
) -> list[dict[str, Any]]:
    """The dataset's readable rows as dicts; unreadable JSONL lines are settled by
    `cfg.on_bad_row` (an error, or one warning per kind to `warn`, stderr by default)."""
    rows = read_rows(cfg, key)
    rows.bad.settle(cfg.on_bad_row, warn or _warn_stderr)
    return rows.rows


def _warn_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _read_jsonl(path: str, key: str) -> Rows:
    """A JSON-lines file read line by line (a .json file holding one array also works)."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    rows, numbers, bad = [], [], BadRows(path, "line", key)
    with open(file, "rb") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith(b"["):
            return _read_json_array(f.read(), path, key)
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                bad.add("invalid UTF-8", n)
                continue
            except json.JSONDecodeError:
                bad.add("invalid JSON", n)
                continue
            if not isinstance(row, dict):
                bad.add("invalid JSON", n)  # a value, not an object of columns
                continue
            rows.append(row)
            numbers.append(n)
    return Rows(rows, numbers, bad)


def _read_json_array(data: bytes, path: str, key: str) -> Rows:
    try:
        items = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read json dataset {path}: {_first_line(exc)}") from exc
    bad = BadRows(path, "row", key)
    rows, numbers = [], []
    for n, item in enumerate(items):
        if isinstance(item, dict):
            rows.append(item)
            numbers.append(n)
        else:
            bad.add("invalid JSON", n)
    return Rows(rows, numbers, bad)


def _load_file(path: str, kind: str) -> Any:
    """A local JSONL or Parquet file as a ``datasets.Dataset`` (``split`` does not apply)."""
    if not Path(path).is_file():
        raise DatasetError(f"dataset file not found: {path}")
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()  # the controller's display owns stdout

    try:
        return load_dataset(
            _BUILDERS[kind], data_files=str(path), split="train", cache_dir=_datasets_cache()
        )
    except Exception as exc:  # datasets raises many types for malformed files
        raise DatasetError(f"cannot read {kind} dataset {path}: {_first_line(exc)}") from exc


def _load_hub(cfg: DatasetConfig) -> Any:
    """A Hub dataset split (from the local cache when offline)."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()

    try:
        return load_dataset(cfg.path, split=cfg.split, cache_dir=_datasets_cache())
    except Exception as exc:
        raise DatasetError(
            f"cannot load Hub dataset {cfg.path!r} (split {cfg.split!r}): {_first_line(exc)}; "
            "download it first (hf download --repo-type dataset NAME) or give a .jsonl/.parquet file"
        ) from exc


def _datasets_cache() -> str:
    """`datasets` keeps the Arrow copies it makes of a dataset under AREAL_CACHE_DIR, not
    under the user's ~/.cache/huggingface (Hub downloads stay in the Hugging Face cache)."""
    from areal_cli.models.builtin import cache_dir

    return str(cache_dir() / "datasets")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, with its type."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _check_columns(columns: Sequence[str], cfg: DatasetConfig) -> None:
    """Raise DatasetError if the prompt or answer column is missing."""
    for option, column in (("prompt_key", cfg.prompt_key), ("answer_key", cfg.answer_key)):
        if column not in columns:
            raise DatasetError(
                f"dataset {cfg.path} has no column {column!r} (dataset.{option}); "
                f"available columns: {', '.join(columns) or 'none'}"
            )


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """A dataset row ready for rollout: its index, tokenized prompt and reference answer."""

    index: int
    input_ids: list[int]
    answer: str
    row: dict[str, Any]


def build_messages(prompt: Any, system_prompt: str) -> list[dict[str, str]]:
    """Chat messages for a prompt: a string becomes one user turn; a message list is kept."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise DatasetError(f"prompt must be a string or a list of messages, got {prompt!r:.80}")
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def format_prompt(tokenizer: Any, row: Mapping[str, Any], cfg: DatasetConfig) -> list[int] | None:
    """Token ids of the row's prompt, or None when longer than ``cfg.max_prompt_len``."""
    prompt = row[cfg.prompt_key]
    if cfg.apply_chat_template:
        ids = chat_ids(tokenizer, build_messages(prompt, cfg.system_prompt))
    else:
        if not isinstance(prompt, str):
            raise DatasetError(
                f"a message-list prompt needs dataset.apply_chat_template: true, got {prompt!r:.80}"
            )
        text = f"{cfg.system_prompt}\n\n{prompt}" if cfg.system_prompt else prompt
        ids = list(tokenizer(text)["input_ids"])
    return ids if len(ids) <= cfg.max_prompt_len else None


def reply_ids(tokenizer: Any, answer: Any, where: str) -> list[int]:
    """An answer's tokens as a model would generate them: its text, then EOS."""
    if not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: answer must be text, got {answer!r:.60}")
    return [*tokenizer.encode(str(answer), add_special_tokens=False), tokenizer.eos_token_id]


def chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Apply the chat template (by default with the generation prompt; with `tools`, the
    OpenAI tool schemas it renders) and return the token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            "the tokenizer has no chat template; set dataset.apply_chat_template: false"
        )
    extra = {"tools": tools} if tools else {}  # only when given: not every tokenizer takes it
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
    )
    # transformers 5 returns a BatchEncoding here, 4.x a plain list of ids.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def row_problem(row: Mapping[str, Any], cfg: DatasetConfig) -> str | None:
    """What makes a row unusable as a prompt with its answer (a bad-row kind), or None."""
    prompt = row.get(cfg.prompt_key)
    if prompt is None:
        return f"no {cfg.prompt_key!r}"
    messages = (
        cfg.apply_chat_template
        and isinstance(prompt, list)
        and all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in prompt)
    )
    if not (isinstance(prompt, str) or messages):
        wanted = "text or a message list" if cfg.apply_chat_template else "text"
        return f"a {cfg.prompt_key!r} that is not {wanted}"
    answer = row.get(cfg.answer_key)
    if answer is None:
        return f"no {cfg.answer_key!r}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"an {cfg.answer_key!r} that is not text or a number"
    return None


def prepare_prompts(
    tokenizer: Any, rows: Rows | Sequence[Mapping[str, Any]], cfg: DatasetConfig
) -> tuple[list[Prompt], BadRows]:
    """Tokenize every usable row; returns the prompts and the bad rows (those of `rows`,
    those that `row_problem` names, and those longer than ``max_prompt_len``)."""
    if not isinstance(rows, Rows):
        rows = Rows(list(rows), list(range(len(rows))), BadRows(cfg.path, "row"))
    bad = rows.bad
    prompts: list[Prompt] = []
    for index, (number, row) in enumerate(zip(rows.numbers, rows.rows, strict=True)):
        problem = row_problem(row, cfg)
        if problem is not None:
            bad.add(problem, number)
            continue
        ids = format_prompt(tokenizer, row, cfg)
        if ids is None:
            bad.add(f"a prompt over max_prompt_len={cfg.max_prompt_len} tokens", number)
            continue
        prompts.append(Prompt(index, ids, str(row[cfg.answer_key]), dict(row)))
    return prompts, bad


def load_dataset_prompts(
    tokenizer: Any, cfg: DatasetConfig, warn: Callable[[str], None], key: str = "dataset"
) -> list[Prompt]:
    """The dataset's prompts for a rollout or an eval, its bad rows settled by
    `cfg.on_bad_row` (raises DatasetError under error, or when no prompt is left)."""
    prompts, bad = prepare_prompts(tokenizer, read_rows(cfg, key), cfg)
    bad.settle(cfg.on_bad_row, warn)
    if not prompts:
        raise DatasetError(f"{cfg.path} has no usable prompt ({'; '.join(bad.warnings())})")
    return prompts


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------


class PromptStream(Generic[T]):
    """Endless batches over ``items``, reshuffled each epoch with ``seed + epoch``; resumable."""

    def __init__(self, items: Sequence[T], *, seed: int = 1, shuffle: bool = True) -> None:
        if not items:
            raise DatasetError("cannot stream an empty dataset")
        self._items = items
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, items: Sequence[T], cfg: DatasetConfig) -> PromptStream[T]:
        """A stream using the recipe's ``seed`` and ``shuffle``."""
        return cls(items, seed=cfg.seed, shuffle=cfg.shuffle)

    @property
    def epoch(self) -> int:
        """Epochs completed (the epoch the next item comes from)."""
        return self._epoch

    def __len__(self) -> int:
        return len(self._items)

    def _epoch_order(self, epoch: int) -> list[int]:
        """Item indices in the order epoch ``epoch`` visits them."""
        order = list(range(len(self._items)))
        if self._shuffle:
            random.Random(self._seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[T]:
        """The next ``n`` items, continuing into the next epoch (reshuffled) when one ends."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        batch: list[T] = []
        while len(batch) < n:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            take = self._order[self._position : self._position + n - len(batch)]
            batch.extend(self._items[i] for i in take)
            self._position += len(take)
        return batch

    def __iter__(self) -> PromptStream[T]:
        return self

    def __next__(self) -> T:
        return self.next_batch(1)[0]

    def state_dict(self) -> dict[str, int]:
        """Where the stream is: epoch, position within it, and the dataset size (a sanity check)."""
        return {"epoch": self._epoch, "position": self._position, "num_items": len(self._items)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly where ``state_dict`` was taken (same items, seed and shuffle)."""
        epoch, position = int(state["epoch"]), int(state["position"])
        size = int(state.get("num_items", len(self._items)))
        if size != len(self._items):
            raise DatasetError(
                f"the checkpoint streamed {size} prompts but the dataset now has "
                f"{len(self._items)}; resume with the same dataset and max_prompt_len"
            )
        if epoch < 0 or not 0 <= position <= len(self._items):
            raise ValueError(f"invalid prompt stream state {dict(state)}")
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)

"""Prompt datasets: loading rows, turning them into prompt token ids, and a resumable stream.

``load_prompts`` reads JSONL, Parquet or a cached Hub dataset with the ``datasets`` library and
checks the configured columns. ``format_prompt`` applies the chat template (or plain tokenization)
and ``prepare_prompts`` drops, and counts, prompts longer than ``max_prompt_len``. ``PromptStream``
hands out batches in a per-epoch shuffled order that a checkpoint can resume exactly.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
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


def dataset_type(cfg: DatasetConfig) -> str:
    """jsonl, parquet or hub: ``cfg.type``, or guessed from the path when it is auto."""
    if cfg.type != "auto":
        return cfg.type
    return _FILE_TYPES.get(Path(cfg.path).suffix.lower(), "hub")


def load_prompts(cfg: DatasetConfig) -> list[dict[str, Any]]:
    """Every row of the dataset as a dict; raises DatasetError naming what is wrong."""
    if not cfg.path:
        raise DatasetError("dataset.path is empty")
    kind = dataset_type(cfg)
    dataset = _load_hub(cfg) if kind == "hub" else _load_file(cfg.path, kind)
    _check_columns(dataset.column_names, cfg)
    rows = dataset.to_list()
    if not rows:
        raise DatasetError(f"dataset {cfg.path} has no rows")
    return rows


def _load_file(path: str, kind: str) -> Any:
    """A local JSONL or Parquet file as a ``datasets.Dataset`` (``split`` does not apply)."""
    if not Path(path).is_file():
        raise DatasetError(f"dataset file not found: {path}")
    from datasets import load_dataset

    try:
        return load_dataset(
            _BUILDERS[kind], data_files=str(path), split="train", cache_dir=_datasets_cache()
        )
    except Exception as exc:  # datasets raises many types for malformed files
        raise DatasetError(f"cannot read {kind} dataset {path}: {_first_line(exc)}") from exc


def _load_hub(cfg: DatasetConfig) -> Any:
    """A Hub dataset split (from the local cache when offline)."""
    from datasets import load_dataset

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
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Apply the chat template (by default with the generation prompt) and return the
    token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            "the tokenizer has no chat template; set dataset.apply_chat_template: false"
        )
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    # transformers 5 returns a BatchEncoding here, 4.x a plain list of ids.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def prepare_prompts(
    tokenizer: Any, rows: Sequence[Mapping[str, Any]], cfg: DatasetConfig
) -> tuple[list[Prompt], int]:
    """Tokenize every row; returns the prompts that fit and how many were too long."""
    prompts: list[Prompt] = []
    for index, row in enumerate(rows):
        ids = format_prompt(tokenizer, row, cfg)
        if ids is not None:
            prompts.append(Prompt(index, ids, str(row[cfg.answer_key]), dict(row)))
    return prompts, len(rows) - len(prompts)


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

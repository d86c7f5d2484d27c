"""A continuous-batching inference engine over any Hugging Face causal-LM folder.

One scheduler thread owns the model. Each loop iteration it runs queued control commands
(abort, pause, weight swap, ...), prefills the newly admitted requests together in one
right-padded forward pass, copies their KV into the running batch, runs one batched decode
step and drops finished rows. Requests therefore join and leave the batch at decode-step
boundaries, and a long request never holds back a short one. When more requests wait
than there are free rows, the default "lof" policy (longest output first, as SGLang names it) admits those with the most
tokens left to generate first (requests queued over `max_queue_wait_s` go first), which
keeps the batch full to the end; a joining group is prefilled in as few passes as pay off
against the right padding between its short and long contexts.

The running batch keeps its KV cache in preallocated per-layer buffers (`_SlotLayer`):
row i holds its `kv_len` tokens left-aligned, a decode step writes each row's new token at
its own column, and a per-row attention mask plus explicit position ids keep rows apart.
So a decode step never copies the cache, a join copies only the new rows, and a leave
moves at most one row per hole.

Logprob convention: for a sampled token the engine returns its log-probability under the
temperature-scaled full softmax, `log_softmax(logits / T)`, taken before top-k/top-p
truncation (truncation only restricts which tokens can be drawn). That is what a trainer
recomputes from the same logits. Greedy requests (temperature 0) report `log_softmax(logits)`.

Field names follow SGLang's `/generate` request and response (`sampling_params`,
`return_logprob`, `rid`, `meta_info.output_token_logprobs`, `finish_reason`, ...).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import json
import logging
import os
import random
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

logger = logging.getLogger(__name__)

T = TypeVar("T")
PauseMode = Literal["abort", "in_place", "retract"]
SchedulePolicy = Literal["fcfs", "lof"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# SGLang sampling keys we accept only at their no-op value, so SGLang clients that always
# send them keep working, while a request that relies on them fails loudly.
_NOOP_SAMPLING_KEYS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "stop": (None, "", []),
    "min_new_tokens": (0,),
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True, False),
    "no_stop_trim": (True, False),
}


class WeightLoadError(Exception):
    """A weight folder that cannot replace the running weights."""


# --------------------------------------------------------------------------- requests


_COERCE: dict[str, Callable[[Any], Any]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_new_tokens": int,
    "stop_token_ids": lambda ids: tuple(int(t) for t in ids),
    "ignore_eos": bool,
    "sampling_seed": int,
    "skip_special_tokens": bool,
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang names). temperature 0 means greedy;
    top_k < 1 and top_p == 1 disable truncation; stop_token_ids stop even with ignore_eos."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        """Build from an SGLang `sampling_params` dict; raises ValueError on unsupported keys."""
        data = dict(data or {})
        for key, allowed in _NOOP_SAMPLING_KEYS.items():
            if key in data and data.pop(key) not in allowed:
                raise ValueError(f"sampling param {key!r} is not supported by this engine")
        unknown = sorted(set(data) - set(_COERCE))
        if unknown:
            raise ValueError(f"unknown sampling params: {', '.join(unknown)}")
        values = {k: _COERCE[k](v) for k, v in data.items() if v is not None}
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise ValueError on out-of-range values."""
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerateRequest:
    """One generation request: a prompt (`input_ids` or `text`) plus sampling settings."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    rid: str | None = None

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> GenerateRequest:
        """Build from a single (non-batched) SGLang `/generate` body."""
        input_ids = body.get("input_ids")
        if input_ids is not None and not all(isinstance(t, int) for t in input_ids):
            raise ValueError("input_ids must be a flat list of integers")
        text = body.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError("text must be a string")
        return cls(
            input_ids=list(input_ids) if input_ids is not None else None,
            text=text,
            sampling_params=SamplingParams.from_dict(body.get("sampling_params")),
            return_logprob=bool(body.get("return_logprob") or False),
            rid=None if body.get("rid") is None else str(body["rid"]),
        )


@dataclass
class GenerateOutput:
    """The result of one request; `to_dict` gives SGLang's `/generate` response."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]
    weight_version: str
    weight_versions: list[dict[str, Any]]
    e2e_latency: float

    def to_dict(self, return_logprob: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "weight_versions": self.weight_versions,
            "e2e_latency": self.e2e_latency,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(self.output_logprobs, self.output_ids, strict=True)
            ]
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler state."""

    weight_version: str
    model_path: str
    paused: bool
    num_running: int
    num_waiting: int
    progress: dict[str, int]  # rid -> output tokens so far, running and waiting requests


class WeightUpdate(NamedTuple):
    """What `update_weights_from_disk` did."""

    ok: bool
    message: str
    stats: EngineStats  # the engine right after the update (or the refusal)


@dataclass(eq=False)
class _Sequence:
    """Scheduler-side state of one request."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    generator: torch.Generator | None
    future: concurrent.futures.Future[GenerateOutput]
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        """Tokens held in the KV cache: everything but the last sampled token."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def record(self, token: int, logprob: float, version: str) -> None:
        """Append one sampled token and extend the weight-version spans."""
        index = len(self.output_ids)
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = index + 1
        else:
            self.spans.append({"version": version, "start": index, "end": index + 1})


# --------------------------------------------------------------------------- sampling


def _truncation_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask (vocab order) of tokens that survive top-k then top-p."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < top_k < probs.numel():
        keep &= probs >= torch.topk(probs, top_k).values[-1]
    if top_p < 1.0:
        sorted_probs, order = torch.sort(torch.where(keep, probs, 0.0), descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # before it already does.
        drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= top_p
        keep[order[drop]] = False
    return keep


def _draw(logprobs: torch.Tensor, seqs: list[_Sequence]) -> torch.Tensor:
    """Inverse-CDF sample of each row in vocabulary order, with one uniform draw from each
    request's own RNG (so a request's tokens do not depend on its batch neighbours).

    Vocabulary order (not probability order) keeps the draw stable under tiny float
    differences between batched and solo runs.
    """
    probs = logprobs.exp()
    vocab = probs.shape[-1]
    for row, seq in enumerate(seqs):
        top_k, top_p = seq.params.top_k, seq.params.top_p
        if 0 < top_k < vocab or top_p < 1.0:
            keep = _truncation_mask(probs[row], top_k, top_p)
            probs[row] = torch.where(keep, probs[row], 0.0)
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in seqs])
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picks.clamp(max=vocab - 1)


def sample_tokens(logits: torch.Tensor, seqs: list[_Sequence]) -> list[tuple[int, float]]:
    """Pick the next token and its logprob for each row of `logits` ([B, V], float32, CPU)."""
    tokens = torch.argmax(logits, dim=-1)  # greedy picks, on the raw logits as HF does
    drawn = [i for i, s in enumerate(seqs) if not s.params.greedy and s.generator is not None]
    if any(not s.params.greedy for s in seqs):
        temps = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs])
        logits = logits / temps[:, None]
    logprobs = torch.log_softmax(logits, dim=-1)
    if drawn:
        tokens[drawn] = _draw(logprobs[drawn], [seqs[i] for i in drawn])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    # One conversion per step: per-row .item() calls dominate small models.
    return list(zip(tokens.tolist(), chosen.tolist(), strict=True))


# A prefill pass costs about this many (padded) prompt tokens on top of its tokens: on CPU
# one pass reads all the weights once, which is worth ~25-50 tokens of compute for 1M-25M
# parameter models.
PREFILL_PASS_COST_TOKENS = 48


def _split_by_length(seqs: list[_Sequence], pass_cost: int) -> list[list[_Sequence]]:
    """Split a prefill group into passes of similar context length, minimising the padded
    tokens plus `pass_cost` per pass (right padding to the longest context in a pass is
    wasted compute). Exact DP over the length-sorted group."""
    if len(seqs) <= 1:
        return [seqs] if seqs else []
    order = sorted(seqs, key=lambda s: s.kv_len)
    sizes = [s.kv_len + 1 for s in order]
    n = len(order)
    best = [0] + [0] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        # the last pass is order[i:j], padded to sizes[j - 1]
        best[j], cut[j] = min((best[i] + pass_cost + (j - i) * sizes[j - 1], i) for i in range(j))
    parts, j = [], n
    while j > 0:
        parts.append(order[cut[j] : j])
        j = cut[j]
    return parts[::-1]


def _rows(index: torch.Tensor) -> torch.Tensor:
    """0..len(index)-1 on index's device, for row-wise gathers."""
    return torch.arange(index.shape[0], device=index.device)


# --------------------------------------------------------------------------- KV cache


class _SlotLayer(DynamicLayer):
    """One layer's keys and values in preallocated [rows, kv_heads, columns, head_dim] buffers.

    Row i of the running batch keeps its `kv_len` cached tokens in columns [0, kv_len) and
    a decode step writes the new token at column kv_len, so a step costs one scatter
    instead of concatenating the whole cache. Attention reads columns [0, width); columns
    past a row's own length hold stale values that the attention mask hides.
    """

    def __init__(self, batch: _RunningBatch) -> None:
        super().__init__()
        self.batch = batch
        self.is_initialized = True
        self.key_buf: torch.Tensor | None = None
        self.value_buf: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch
        n, width = len(batch.seqs), batch.past + 1
        _, heads, columns, dim = self.key_buf.shape
        # One flat index_copy_ per buffer: far cheaper than advanced-index assignment.
        slots = batch.slots(heads, columns)
        self.key_buf.view(-1, dim).index_copy_(0, slots, key_states.reshape(-1, dim))
        self.value_buf.view(-1, dim).index_copy_(0, slots, value_states.reshape(-1, dim))
        return self.key_buf[:n, :, :width], self.value_buf[:n, :, :width]

    def get_seq_length(self) -> int:
        return self.batch.past


class _RunningBatch:
    """The decoding sequences and their shared slot cache (see `_SlotLayer`).

    Buffers grow by doubling (rows up to the batch cap, columns as sequences grow) and are
    released when the batch empties. A sequence that leaves is replaced by a row moved
    from the end, so removals copy only the moved rows.
    """

    def __init__(self, config: Any, max_rows: int) -> None:
        self.max_rows = max_rows
        self.seqs: list[_Sequence] = []
        self.cache = DynamicCache(config=config)
        self.layers = [_SlotLayer(self) for _ in self.cache.layers]
        self.cache.layers = list(self.layers)
        self.past = 0  # cached columns in use: the longest kv_len
        self.columns = torch.zeros(0, dtype=torch.long)  # where each row writes this step
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    def slots(self, heads: int, columns: int) -> torch.Tensor:
        """Flat [row, head, column] offsets this step writes, row-major over (row, head)."""
        key = (heads, columns)
        if key not in self._slots:
            rows = torch.arange(len(self.seqs), device=self.columns.device)
            head = torch.arange(heads, device=self.columns.device)
            offsets = (rows[:, None] * heads + head[None, :]) * columns + self.columns[:, None]
            self._slots[key] = offsets.reshape(-1)
        return self._slots[key]

    def clear(self) -> None:
        self.seqs = []
        for layer in self.layers:
            layer.key_buf = layer.value_buf = None

    @torch.inference_mode()
    def merge(self, seqs: list[_Sequence], cache: DynamicCache, index: list[int]) -> None:
        """Add freshly prefilled sequences: rows `index` of a prefill `cache`."""
        first, width = len(self.seqs), cache.get_seq_length()
        self.seqs.extend(seqs)
        like = [layer.keys for layer in cache.layers]
        self._reserve(len(self.seqs), max(s.kv_len for s in self.seqs) + 1, like)
        pick = torch.tensor(index, device=self.layers[0].key_buf.device)
        for layer, source in zip(self.layers, cache.layers, strict=True):
            layer.key_buf[first : len(self.seqs), :, :width] = source.keys.index_select(0, pick)
            layer.value_buf[first : len(self.seqs), :, :width] = source.values.index_select(0, pick)

    @torch.inference_mode()
    def keep(self, keep: list[bool]) -> None:
        """Drop rows whose flag is False, filling the holes with rows from the end."""
        n = sum(keep)
        if n == len(self.seqs):
            return
        if n == 0:
            self.clear()
            return
        holes = [i for i in range(n) if not keep[i]]
        movers = [i for i in range(n, len(keep)) if keep[i]]
        if holes:
            width = max(self.seqs[i].kv_len for i in movers) + 1
            device = self.layers[0].key_buf.device
            dst, src = torch.tensor(holes, device=device), torch.tensor(movers, device=device)
            for layer in self.layers:
                for buf in (layer.key_buf, layer.value_buf):
                    buf[dst, :, :width] = buf[src, :, :width]
        seqs = self.seqs[:n]
        for hole, mover in zip(holes, movers, strict=True):
            seqs[hole] = self.seqs[mover]
        self.seqs = seqs

    def _reserve(self, rows: int, columns: int, like: list[torch.Tensor] | None = None) -> None:
        """Make the buffers hold at least `rows` x `columns`, keeping their contents; `like`
        gives each layer's heads, head size, dtype and device when nothing is allocated."""
        buf = self.layers[0].key_buf
        if buf is not None and buf.shape[0] >= rows and buf.shape[2] >= columns:
            return
        have_rows, have_cols = (0, 0) if buf is None else (buf.shape[0], buf.shape[2])
        new_rows = min(self.max_rows, max(rows, 2 * have_rows, 4))
        new_cols = max(columns, 2 * have_cols, 64)
        like = like or [layer.key_buf for layer in self.layers]
        for layer, ref in zip(self.layers, like, strict=True):
            for name in ("key_buf", "value_buf"):
                old = getattr(layer, name)
                new = ref.new_zeros(new_rows, ref.shape[1], new_cols, ref.shape[3])
                if old is not None:
                    new[:have_rows, :, :have_cols] = old
                setattr(layer, name, new)

    @torch.inference_mode()
    def decode_inputs(self, device: torch.device, sdpa: bool) -> dict[str, torch.Tensor]:
        """Last tokens, true positions and the padding mask for one decode step. With SDPA
        attention the mask is given ready-made ([rows, 1, 1, columns], True = attend), which
        saves transformers building it every step."""
        kv_lens = [s.kv_len for s in self.seqs]
        lens = torch.tensor(kv_lens, device=device)
        self.past = max(kv_lens)
        self._reserve(len(self.seqs), self.past + 1)
        self.columns = lens
        self._slots.clear()
        mask = torch.arange(self.past + 1, device=device)[None, :] <= lens[:, None]
        return {
            "input_ids": torch.tensor([s.output_ids[-1] for s in self.seqs], device=device)[
                :, None
            ],
            "position_ids": lens[:, None],
            "attention_mask": mask[:, None, None, :] if sdpa else mask.long(),
        }


# --------------------------------------------------------------------------- weights


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, honouring a shard index."""
    try:
        names = os.listdir(folder)  # one call: this runs on the critical path of every update
    except OSError:
        raise WeightLoadError(f"model path {folder} does not exist or is not a directory") from None
    index = folder / "model.safetensors.index.json"
    if index.name in names:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise WeightLoadError(f"unreadable shard index {index}: {exc}") from exc
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise WeightLoadError(f"{folder} is incomplete: missing shard(s) {_names(missing)}")
        return [folder / s for s in shards]
    files = sorted(folder / n for n in names if n.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {folder}")
    return files


def _read_safetensors(files: list[Path], buffers: list[bytearray]) -> dict[str, torch.Tensor]:
    """Read every tensor of the given files to CPU; corrupt or truncated files raise.

    The tensors are views of `buffers` (one per file, reused between calls and updated in
    place), so the caller must be done with them before the next call."""
    from areal_cli.weights.safetensors_io import read_tensors

    tensors: dict[str, torch.Tensor] = {}
    for i, path in enumerate(files):
        try:
            loaded, buffer = read_tensors(path, buffers[i] if i < len(buffers) else None)
        except (OSError, ValueError) as exc:
            raise WeightLoadError(f"cannot read {path}: {exc}") from exc
        buffers[i : i + 1] = [buffer]
        for name, tensor in loaded.items():
            if name in tensors:
                raise WeightLoadError(f"tensor {name} appears in more than one file")
            tensors[name] = tensor
    return tensors


def _identity(files: list[Path]) -> tuple:
    """What tells one version of a weights folder from another: its files' inodes, sizes
    and modification times (handoff entries are never modified once renamed in)."""
    identity = []
    for path in files:
        try:
            st = path.stat()
        except OSError as exc:
            raise WeightLoadError(f"cannot read {path}: {exc}") from exc
        identity.append((path.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(identity)


class _ReadAhead(NamedTuple):
    """Weights read and validated before anyone asked for them (in the staging buffers)."""

    folder: Path
    identity: tuple
    tensors: dict[str, torch.Tensor]


def _names(names: Iterable[str], limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class _WeightTable:
    """The model's tensors by checkpoint name; tied tensors accept any of their names."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live: dict[str, torch.Tensor] = {}
        self.alias: dict[str, str] = {}
        first_name: dict[int, str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            canonical = first_name.setdefault(id(tensor), name)
            self.alias[name] = canonical
            self.live.setdefault(canonical, tensor)

    def match(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map checkpoint tensors onto live tensors (cast, on device), or raise WeightLoadError."""
        unexpected = sorted(n for n in loaded if n not in self.alias)
        found = {self.alias[n]: t for n, t in loaded.items() if n in self.alias}
        missing = sorted(n for n in self.live if n not in found)
        wrong = [
            f"{n}: checkpoint {list(t.shape)} {t.dtype} vs model {list(live.shape)} {live.dtype}"
            for n, t in sorted(found.items())
            if t.shape != (live := self.live[n]).shape
            or t.is_floating_point() != live.is_floating_point()
        ]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensor(s): {_names(missing)}")
        if wrong:
            problems.append(f"{len(wrong)} shape/dtype mismatch(es): {_names(wrong, 3)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
        if problems:
            raise WeightLoadError("; ".join(problems))
        return {
            n: t.to(device=self.live[n].device, dtype=self.live[n].dtype) for n, t in found.items()
        }

    @torch.no_grad()
    def swap_in(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Make `tensors` the live weights. On the CPU the live tensors just take over their
        memory (no copy); accelerator weights are copied into, so their memory stays put.
        Returns whether the live weights now alias `tensors`' memory."""
        aliased = False
        for name, tensor in tensors.items():
            live = self.live[name]
            if live.device.type == "cpu":
                live.data = tensor  # same Parameter object: tied modules follow
                aliased = True
            else:
                live.copy_(tensor)
        return aliased


# --------------------------------------------------------------------------- engine


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _shutdown_if_alive(ref: weakref.ref[InferenceEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


class InferenceEngine:
    """Continuous-batching generation with hot weight reload; see the module docstring.

    Thread-safe: `submit`/`generate` and the control methods may be called from any thread.
    Control methods block until the scheduler has applied them (at most one decode step).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "auto",
        max_running_requests: int = 32,
        weight_version: str = "default",
        random_seed: int = 0,
        max_prefill_tokens: int = 8192,
        context_length: int | None = None,
        schedule_policy: SchedulePolicy = "lof",
        max_queue_wait_s: float = 10.0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if schedule_policy not in ("fcfs", "lof"):
            raise ValueError(f"unknown schedule_policy {schedule_policy!r}")
        self.schedule_policy = schedule_policy
        self.max_queue_wait_s = max_queue_wait_s
        self.model_path = str(model_path)
        self.device = resolve_device(device)
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[dtype])
        self.model.to(self.device).eval()
        self.config = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = context_length or int(
            getattr(self.config, "max_position_embeddings", 0) or 2048
        )
        self.eos_token_ids = self._eos_ids()
        self._cache_kwarg = self._check_cache_support()
        self._weights = _WeightTable(self.model)
        self._weight_version = weight_version
        self._seed_rng = random.Random(random_seed)
        self._batch = _RunningBatch(self.config, max_running_requests)
        self._paused = False
        self._stopping = False
        self._cv = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._inflight: dict[str, _Sequence] = {}
        # Weight updates read into `_staging`; on the CPU the model then runs on that memory
        # and the buffers it ran on before become the next staging (scheduler thread only).
        self._staging: list[bytearray] = []
        self._serving: list[bytearray] = []
        self._read_ahead: _ReadAhead | None = None
        self._served_identity: tuple = ()  # of the files last swapped in
        self._staging_lock = threading.Lock()  # staging, serving and read_ahead
        self._thread = threading.Thread(target=self._loop, name="areal-engine", daemon=True)
        self._thread.start()
        # A scheduler thread still inside torch at interpreter exit aborts the process.
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    # ------------------------------------------------------------------ setup helpers

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value is not None:
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def _check_cache_support(self) -> str:
        """Return the forward kwarg that takes the cache; refuse non-uniform caches."""
        layers = DynamicCache(config=self.config).layers
        if not all(type(layer) is DynamicLayer for layer in layers):
            raise NotImplementedError(
                "models with sliding-window, linear-attention or hybrid caches are not supported"
            )
        params = inspect.signature(self.model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ properties

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def is_paused(self) -> bool:
        return self._paused

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------------ generation API

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future[GenerateOutput]:
        """Queue a request; the future resolves when it finishes or is aborted."""
        seq = self._make_sequence(request)
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            if seq.rid in self._inflight:
                raise ValueError(f"a request with rid {seq.rid!r} is already running")
            self._inflight[seq.rid] = seq
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq.future

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Await one request; cancelling the awaiting task aborts the request."""
        future = self.submit(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller went away (e.g. an HTTP client disconnected): free the batch slot.
            with contextlib.suppress(RuntimeError):
                self._post(lambda: self._abort_where(lambda s: s.future is future, "cancelled"))
            raise

    def generate_sync(
        self, request: GenerateRequest, timeout: float | None = None
    ) -> GenerateOutput:
        """Blocking helper for scripts and tests."""
        return self.submit(request).result(timeout)

    def _make_sequence(self, request: GenerateRequest) -> _Sequence:
        """Validate and tokenise a request."""
        if (request.input_ids is None) == (request.text is None):
            raise ValueError("give exactly one of input_ids or text")
        ids = request.input_ids
        if ids is None:
            ids = self.tokenizer(request.text)["input_ids"]
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        params = request.sampling_params
        params.validate()
        seed = params.sampling_seed
        if seed is None:
            seed = self._seed_rng.getrandbits(63)
        generator = None if params.greedy else torch.Generator().manual_seed(seed)
        future: concurrent.futures.Future[GenerateOutput] = concurrent.futures.Future()
        # RUNNING futures cannot be cancelled, so only the scheduler ever resolves them.
        future.set_running_or_notify_cancel()
        return _Sequence(
            rid=request.rid or uuid.uuid4().hex,
            prompt_ids=ids,
            params=params,
            return_logprob=request.return_logprob,
            generator=generator,
            future=future,
        )

    # ------------------------------------------------------------------ control API

    def abort(self, rid: str) -> bool:
        """Abort one request (running or queued); False if it is unknown or finished."""
        return self._call(lambda: self._abort_where(lambda s: s.rid == rid, "aborted")) > 0

    def abort_all(self) -> int:
        """Abort every request; return how many were aborted."""
        return self._call(lambda: self._abort_where(lambda s: True, "aborted (abort_all)"))

    def pause(self, mode: PauseMode = "abort") -> int:
        """Stop generating. "abort" ends all in-flight requests with partial output;
        "in_place" keeps their state and KV cache; "retract" requeues them (their cache
        is recomputed on continue). Returns the number of requests affected."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"unknown pause mode {mode!r}")
        return self._call(lambda: self._do_pause(mode))

    def continue_generation(self) -> None:
        """Resume after `pause`."""
        self._call(self._do_continue)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Relabel the running weights without loading anything."""
        self._call(lambda: self._set_version(new_version, abort_all_requests))

    def flush_cache(self) -> bool:
        """There is no prefix cache to flush; kept for SGLang API parity."""
        return True

    def stats(self, timeout: float = 30.0) -> EngineStats:
        """A consistent snapshot taken on the scheduler thread."""
        return self._call(self._snapshot, timeout)

    def submit_weight_update(
        self,
        model_path: str | Path,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> concurrent.futures.Future[WeightUpdate]:
        """Queue a weight update; the future gives its outcome.

        The scheduler thread reads and validates `model_path` at the next decode-step
        boundary and swaps it in atomically (decoding waits meanwhile, as in SGLang). On
        any problem the outcome has ok=False with the reason, and the old weights keep
        serving. In-flight requests keep their KV cache and continue on the new weights;
        their `weight_versions` spans show where the switch happened. Doing it all on the
        scheduler thread takes one thread handoff instead of three, which is most of the
        cost of reloading a small model."""
        path, abort = Path(model_path), abort_all_requests
        return self._post(lambda: self._load_and_swap(path, weight_version, abort))

    def read_ahead(self, model_path: str | Path) -> bool:
        """Read and validate `model_path` now, on the calling thread, while decoding goes
        on; a later update from the same, unchanged files then only swaps them in. On the
        CPU only (an accelerator would need a second copy of the weights in its memory).
        Returns whether the weights are ready; a folder that cannot be loaded is left for
        the update request to refuse with the reason."""
        if self.device.type != "cpu":
            return False
        folder = Path(model_path)
        with self._staging_lock:
            try:
                files = _safetensors_files(folder)
                identity = _identity(files)
                if identity == self._served_identity:  # its update came first
                    return True
                self._read_ahead = None
                tensors = self._weights.match(_read_safetensors(files, self._staging))
            except WeightLoadError as exc:
                logger.debug("not read ahead: %s: %s", folder, exc)
                return False
            self._read_ahead = _ReadAhead(folder, identity, tensors)
        return True

    @property
    def read_ahead_folder(self) -> Path | None:
        """The folder whose weights are read ahead and waiting for their update, if any."""
        ahead = self._read_ahead
        return ahead.folder if ahead is not None else None

    def watch_for_weights(
        self, directory: str | Path, prefix: str = "v", poll_s: float = 0.5
    ) -> None:
        """Read ahead every handoff entry renamed into `directory` (e.g. RUN/weights) from
        now on, on a background thread: the controller's `/update_weights_from_disk` for it
        then costs a swap, not a read. inotify wakes the thread at once; `poll_s` is the
        fallback where renames are not reported (another node's NFS writes)."""
        if self.device.type != "cpu":
            logger.info("weights read-ahead is off on %s", self.device)
            return
        thread = threading.Thread(
            target=self._read_ahead_loop,
            args=(Path(directory), prefix, poll_s),
            name="areal-read-ahead",
            daemon=True,
        )
        thread.start()

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> WeightUpdate:
        """`submit_weight_update`, waiting for the outcome."""
        future = self.submit_weight_update(
            model_path, weight_version, abort_all_requests=abort_all_requests
        )
        return future.result(300.0)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the scheduler; unfinished requests end with an abort finish reason."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ command plumbing

    def _post(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            self._commands.append((fn, future))
            self._cv.notify_all()
        return future

    def _call(self, fn: Callable[[], T], timeout: float | None = 300.0) -> T:
        return self._post(fn).result(timeout)

    # ------------------------------------------------------------------ scheduler thread

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, future in commands:
                self._run_command(fn, future)
            if commands:
                # Let the threads waiting for these results run now: on a busy core the
                # OS would otherwise leave them queued behind the next steps (~2 ms).
                os.sched_yield()
            if not self._paused:
                self._step()
        self._shutdown_cleanup()

    def _step(self) -> None:
        """Admit, then decode once; an unexpected error fails the batch, not the thread."""
        try:
            self._admit()
            self._decode()
        except Exception as exc:
            logger.exception("scheduler step failed; failing %d requests", len(self._batch.seqs))
            for seq in self._batch.seqs:
                self._fail(seq, exc)
            self._batch.clear()

    def _has_work(self) -> bool:
        runnable = not self._paused and (self._waiting or self._batch.seqs)
        return bool(self._stopping or self._commands or runnable)

    @staticmethod
    def _run_command(fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        try:
            future.set_result(fn())
        except Exception as exc:  # handed back to the caller
            future.set_exception(exc)

    def _shutdown_cleanup(self) -> None:
        self._abort_where(lambda s: True, "engine shut down")
        with self._cv:
            commands = list(self._commands)
            self._commands.clear()
        for _, future in commands:
            future.set_exception(RuntimeError("engine is shut down"))

    def _admit(self) -> None:
        """Prefill queued requests together (up to the batch cap and the padded token
        budget) and merge the survivors into the running batch."""
        group: list[_Sequence] = []
        width = 0
        room = self.max_running_requests - len(self._batch.seqs)
        with self._cv:
            if self.schedule_policy == "lof" and len(self._waiting) > room > 0:
                self._reorder_waiting()
            while self._waiting and len(group) < room:
                size = self._waiting[0].kv_len + 1
                padded = (len(group) + 1) * max(width, size)
                if group and padded > self.max_prefill_tokens:
                    break
                group.append(self._waiting.popleft())
                width = max(width, size)
        for part in _split_by_length(group, PREFILL_PASS_COST_TOKENS):
            self._prefill(part)

    def _reorder_waiting(self) -> None:
        """Longest-first: when more requests wait than there are free rows, admit those
        with the most tokens left to generate first, so that the batch stays full to the
        end instead of trailing off with a few long requests (fewer decode steps for the
        same tokens). A request that has waited `max_queue_wait_s` goes first, in arrival
        order, so short requests are never starved. Caller holds `_cv`."""
        now = time.monotonic()

        def key(seq: _Sequence) -> tuple[bool, float]:
            if now - seq.created >= self.max_queue_wait_s:
                return (False, seq.created)
            return (True, -(seq.params.max_new_tokens - len(seq.output_ids)))

        self._waiting = deque(sorted(self._waiting, key=key))

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Prefill right-padded contexts in one forward pass and sample each next token."""
        contexts = [s.prompt_ids + s.output_ids for s in seqs]
        lens = torch.tensor([len(c) for c in contexts], device=self.device)
        width = int(lens.max())
        ids = [c + [0] * (width - len(c)) for c in contexts]  # 0: any valid id, masked out
        columns = torch.arange(width, device=self.device)
        cache = DynamicCache(config=self.config)
        try:
            logits = self._forward(
                input_ids=torch.tensor(ids, device=self.device),
                position_ids=columns[None, :].expand(len(seqs), -1),
                attention_mask=(columns[None, :] < lens[:, None]).long(),
                cache=cache,
                last=lens - 1,
            )
        except Exception as exc:
            logger.exception("prefill failed for %d request(s)", len(seqs))
            for seq in seqs:
                self._fail(seq, exc)
            return
        alive = self._advance(seqs, logits)
        index = [i for i, a in enumerate(alive) if a]
        if index:
            self._batch.merge([seqs[i] for i in index], cache, index)

    def _decode(self) -> None:
        """One batched decode step over the running batch."""
        batch = self._batch
        if not batch.seqs:
            return
        inputs = batch.decode_inputs(self.device, self.config._attn_implementation == "sdpa")
        logits = self._forward(**inputs, cache=batch.cache)
        batch.keep(self._advance(batch.seqs, logits))

    def _forward(
        self, cache: DynamicCache, last: torch.Tensor | None = None, **inputs: torch.Tensor
    ) -> torch.Tensor:
        """Run the model; return float32 CPU logits at each row's `last` position (default:
        the final one), projecting only those positions onto the vocabulary."""
        keep: int | torch.Tensor = 1
        if last is not None:
            keep, last = torch.unique(last, return_inverse=True)
        with torch.inference_mode():
            out = self.model(
                **inputs, **{self._cache_kwarg: cache}, use_cache=True, logits_to_keep=keep
            )
            logits = out.logits[:, -1] if last is None else out.logits[_rows(last), last]
        return logits.float().cpu()

    def _advance(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[bool]:
        """Sample one token per sequence, finish those that stop; True = still running."""
        alive = []
        for seq, (token, logprob) in zip(seqs, sample_tokens(logits, seqs), strict=True):
            seq.record(token, logprob, self._weight_version)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._complete(seq, reason)
            alive.append(reason is None)
        return alive

    def _finish_reason(self, seq: _Sequence, token: int) -> dict[str, Any] | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return {"type": "stop", "matched": token}
        if len(seq.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(seq.output_ids)}
        if seq.kv_len + 1 >= self.context_length:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    # ------------------------------------------------------------------ finishing

    def _complete(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        with self._cv:
            self._inflight.pop(seq.rid, None)
        version = seq.spans[-1]["version"] if seq.spans else self._weight_version
        seq.future.set_result(
            GenerateOutput(
                rid=seq.rid,
                prompt_ids=seq.prompt_ids,
                output_ids=list(seq.output_ids),
                output_logprobs=list(seq.logprobs),
                text=self.tokenizer.decode(
                    seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
                ),
                finish_reason=reason,
                weight_version=version,
                weight_versions=[dict(s) for s in seq.spans],
                e2e_latency=time.monotonic() - seq.created,
            )
        )

    def _fail(self, seq: _Sequence, exc: BaseException) -> None:
        with self._cv:
            self._inflight.pop(seq.rid, None)
        if not seq.future.done():  # it may have finished earlier in the failing step
            seq.future.set_exception(exc)

    def _abort_where(self, pred: Callable[[_Sequence], bool], message: str) -> int:
        """Abort matching running and queued requests with their partial output."""
        with self._cv:
            queued = [s for s in self._waiting if pred(s)]
            self._waiting = deque(s for s in self._waiting if not pred(s))
        running = [pred(s) for s in self._batch.seqs]
        aborted = queued + [s for s, hit in zip(self._batch.seqs, running, strict=True) if hit]
        self._batch.keep([not hit for hit in running])
        for seq in aborted:
            self._complete(seq, {"type": "abort", "message": message})
        return len(aborted)

    # ------------------------------------------------------------------ commands

    def _do_pause(self, mode: PauseMode) -> int:
        self._paused = True
        if mode == "abort":
            return self._abort_where(lambda s: True, "aborted by pause_generation")
        if mode == "retract":
            retracted = list(self._batch.seqs)
            self._batch.clear()
            with self._cv:
                self._waiting.extendleft(reversed(retracted))
            return len(retracted)
        return len(self._batch.seqs)

    def _do_continue(self) -> None:
        self._paused = False

    def _set_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self._abort_where(lambda s: True, "aborted by update_weight_version")
        self._weight_version = version

    def _read_weights(self, path: Path) -> tuple[dict[str, torch.Tensor], tuple, bool]:
        """Validated tensors of `path` in the staging buffers, the files' identity, and
        whether they had been read ahead. Hold `_staging_lock`."""
        files = _safetensors_files(path)
        identity = _identity(files)
        ahead, self._read_ahead = self._read_ahead, None  # staging gets reused either way
        if ahead is not None and ahead.identity == identity:
            return ahead.tensors, identity, True
        return self._weights.match(_read_safetensors(files, self._staging)), identity, False

    def _load_and_swap(
        self, path: Path, weight_version: str | None, abort_all: bool
    ) -> WeightUpdate:
        """Scheduler thread: read (or take what was read ahead), validate, swap in."""
        old = self._weight_version
        with self._staging_lock:
            try:
                tensors, identity, ahead = self._read_weights(path)
            except WeightLoadError as exc:
                message = f"refused weights from {path}: {exc}; still serving {old!r}"
                logger.warning(message)
                return WeightUpdate(False, message, self._snapshot())
            if abort_all:
                self._abort_where(lambda s: True, "aborted by update_weights_from_disk")
            if self._weights.swap_in(tensors):
                self._staging, self._serving = self._serving, self._staging
            self._served_identity = identity
        version = old if weight_version is None else str(weight_version)
        self._weight_version = version
        self.model_path = str(path)
        how = "read ahead" if ahead else "read now"
        logger.info("weights swapped to %s (version %s, %s)", path, version, how)
        message = f"loaded weights from {path} ({how}); weight version {old!r} -> {version!r}"
        return WeightUpdate(True, message, self._snapshot())

    # ------------------------------------------------------------------ read-ahead thread

    def _read_ahead_loop(self, directory: Path, prefix: str, poll_s: float) -> None:
        from areal_cli.weights import handoff

        watcher = handoff.Watcher(directory)  # before the first look: no rename is missed
        try:
            newest = handoff.latest(directory, prefix)  # already there: not worth reading
            seen = newest.version if newest is not None else -1
            while not self._stopping:
                entry = handoff.newest_after(directory, prefix, seen)
                if entry is None:
                    watcher.wait(poll_s)
                    continue
                seen = entry.version
                self.read_ahead(entry.path)
        except Exception:  # never take the server down: updates just read on request
            logger.exception("weights read-ahead of %s stopped", directory)
        finally:
            watcher.close()

    def _snapshot(self) -> EngineStats:
        with self._cv:
            waiting = list(self._waiting)
        return EngineStats(
            weight_version=self._weight_version,
            model_path=self.model_path,
            paused=self._paused,
            num_running=len(self._batch.seqs),
            num_waiting=len(waiting),
            progress={s.rid: len(s.output_ids) for s in [*self._batch.seqs, *waiting]},
        )

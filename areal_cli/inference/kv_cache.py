"""The running batch's KV cache: preallocated per-layer slots, joined and left by rows.

The running batch keeps its KV cache in preallocated per-layer buffers (`SlotLayer`):
row i holds its `kv_len` tokens left-aligned, a decode step writes each row's new token at
its own column, and a per-row attention mask plus explicit position ids keep rows apart.
So a decode step never copies the cache, a join copies only the new rows, and a leave
moves at most one row per hole.

The caches here are plain objects with the one method a model calls,
`update(key, value, layer_index)` (`LayerCache`), which our own decoder
(areal_cli.models.decoder) uses as they are. A transformers model instead wants its own
`DynamicCache`: `hf_slot_cache` wraps the same layers into one. That is the one place that
touches transformers' cache internals (`DynamicLayer`), so a transformers upgrade that
changes them touches this file only.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from areal_cli.inference.sampling import SeqState


def cache_kwarg(model: Any) -> str:
    """The forward kwarg of a transformers `model` that takes the cache; refuse
    non-uniform caches."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    if not all(type(layer) is DynamicLayer for layer in layers):
        raise NotImplementedError(
            "models with sliding-window, linear-attention or hybrid caches are not supported"
        )
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def row_index(index: torch.Tensor) -> torch.Tensor:
    """0..len(index)-1 on index's device, for row-wise gathers."""
    return torch.arange(index.shape[0], device=index.device)


class PrefillLayer:
    """One layer's keys and values of a prefill pass, as the model gave them."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:  # a second pass over the same cache: append
            key_states = torch.cat([self.keys, key_states], dim=-2)
            value_states = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]


class LayerCache:
    """A model's cache over per-layer objects (`PrefillLayer` or `SlotLayer`)."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].update(key, value)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()


def hf_slot_cache(config: Any, batch: RunningBatch) -> Any:
    """A transformers DynamicCache for `config` over `batch`'s slot layers (each also a
    DynamicLayer, for the methods transformers calls besides update)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layer_class = type("HFSlotLayer", (SlotLayer, DynamicLayer), {})
    cache.layers = [layer_class(batch) for _ in cache.layers]
    for layer in cache.layers:
        layer.is_initialized = True
    return cache


def prefill_cache(config: Any, hf: bool) -> Any:
    """An empty cache for one prefill pass (a transformers model's own DynamicCache)."""
    if hf:
        from transformers import DynamicCache

        return DynamicCache(config=config)
    return LayerCache([PrefillLayer() for _ in range(config.num_hidden_layers)])


def slot_offsets(positions: torch.Tensor, heads: int, columns: int) -> torch.Tensor:
    """Flat offsets into [rows, heads, columns, head_dim] buffers (viewed as [-1,
    head_dim]) where row r writes its new token, at column positions[r] ([rows, 1]) of every
    head; row-major over (row, head), as a [rows, heads, 1, dim] key reshapes."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    head = torch.arange(heads, device=positions.device)[None, :]
    return ((rows * heads + head) * columns + positions).reshape(-1)


class SlotLayer:
    """One layer's keys and values in preallocated [rows, kv_heads, columns, head_dim] buffers.

    Row i of the running batch keeps its `kv_len` cached tokens in columns [0, kv_len) and
    a decode step writes the new token at column kv_len, so a step costs one scatter
    instead of concatenating the whole cache. Attention reads columns [0, width); columns
    past a row's own length hold stale values that the attention mask hides.
    """

    def __init__(self, batch: RunningBatch) -> None:
        super().__init__()
        self.batch = batch
        self.key_buf: torch.Tensor | None = None
        self.value_buf: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch
        _, heads, columns, _ = self.key_buf.shape
        slots = batch.slots(heads, columns)
        return self.write(slots, key_states, value_states, len(batch.seqs), batch.past + 1)

    def write(
        self, offsets: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values at flat `offsets` (`slot_offsets`) and return the
        first `rows` x `width` of both buffers, for attention. One flat index_copy_ per
        buffer: far cheaper than advanced-index assignment."""
        dim = self.key_buf.shape[3]
        self.key_buf.view(-1, dim).index_copy_(0, offsets, key.reshape(-1, dim))
        self.value_buf.view(-1, dim).index_copy_(0, offsets, value.reshape(-1, dim))
        return self.key_buf[:rows, :, :width], self.value_buf[:rows, :, :width]

    def get_seq_length(self) -> int:
        return self.batch.past


class RunningBatch:
    """The decoding sequences and their shared slot cache (see `SlotLayer`).

    Buffers grow by doubling (rows up to the batch cap, columns as sequences grow) and are
    released when the batch empties (but with `hold_buffers`, for decode graphs). A
    sequence that leaves is replaced by a row moved from the end, so removals copy only the
    moved rows.
    """

    def __init__(self, config: Any, max_rows: int, hf: bool = False) -> None:
        self.max_rows = max_rows
        self.seqs: list[SeqState] = []
        if hf:  # a transformers model: its own cache class, over these layers
            self.cache = hf_slot_cache(config, self)
            self.layers = list(self.cache.layers)
        else:
            self.layers = [SlotLayer(self) for _ in range(config.num_hidden_layers)]
            self.cache = LayerCache(self.layers)
        self.past = 0  # cached columns in use: the longest kv_len
        self.columns = torch.zeros(0, dtype=torch.long)  # where each row writes this step
        self._slots: dict[tuple[int, int], torch.Tensor] = {}
        # Decode graphs (inference.graphs) record the buffers' addresses: they then get
        # every row at once and keep them while the batch is empty (until `clear`).
        self.hold_buffers = False
        # Bumped whenever the buffers are replaced or dropped: a graph recorded over
        # older ones is stale (new buffers may even come back at the same addresses).
        self.generation = 0

    def slots(self, heads: int, columns: int) -> torch.Tensor:
        """Flat [row, head, column] offsets this step writes, row-major over (row, head)."""
        key = (heads, columns)
        if key not in self._slots:
            self._slots[key] = slot_offsets(self.columns[:, None], heads, columns)
        return self._slots[key]

    @property
    def nbytes(self) -> int:
        """The KV buffers' size now (0 while the batch is empty)."""
        return sum(
            buf.nbytes
            for layer in self.layers
            for buf in (layer.key_buf, layer.value_buf)
            if buf is not None
        )

    def clear(self) -> None:
        self.seqs = []
        for layer in self.layers:
            layer.key_buf = layer.value_buf = None
        self.generation += 1

    @torch.inference_mode()
    def merge(self, seqs: list[SeqState], cache: Any, index: list[int]) -> None:
        """Add freshly prefilled sequences: rows `index` of a prefill `cache`."""
        first, width = len(self.seqs), cache.get_seq_length()
        self.seqs.extend(seqs)
        like = [layer.keys for layer in cache.layers]
        self.reserve(len(self.seqs), max(s.kv_len for s in self.seqs) + 1, like)
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
            if self.hold_buffers:
                self.seqs = []
            else:
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

    def reserve(self, rows: int, columns: int, like: list[torch.Tensor] | None = None) -> None:
        """Make the buffers hold at least `rows` x `columns`, keeping their contents; `like`
        gives each layer's heads, head size, dtype and device when nothing is allocated.
        With `hold_buffers`, every row is allocated at once."""
        buf = self.layers[0].key_buf
        if buf is not None and buf.shape[0] >= rows and buf.shape[2] >= columns:
            return
        have_rows, have_cols = (0, 0) if buf is None else (buf.shape[0], buf.shape[2])
        # Only a dimension that is short grows (doubling), so that a batch filling up row
        # by row does not double its columns with every new row.
        new_rows, new_cols = have_rows, have_cols
        if self.hold_buffers:
            new_rows = max(self.max_rows, rows)
        elif rows > have_rows:
            new_rows = min(self.max_rows, max(rows, 2 * have_rows, 4))
        if columns > have_cols:
            new_cols = max(columns, 2 * have_cols, 64)
        like = like or [layer.key_buf for layer in self.layers]
        for layer, ref in zip(self.layers, like, strict=True):
            for name in ("key_buf", "value_buf"):
                old = getattr(layer, name)
                new = ref.new_zeros(new_rows, ref.shape[1], new_cols, ref.shape[3])
                if old is not None:
                    new[:have_rows, :, :have_cols] = old
                setattr(layer, name, new)
        self.generation += 1

    @torch.inference_mode()
    def decode_inputs(self, device: torch.device, sdpa: bool) -> dict[str, torch.Tensor]:
        """Last tokens, true positions and the padding mask for one decode step. With SDPA
        attention the mask is given ready-made ([rows, 1, 1, columns], True = attend), which
        saves transformers building it every step."""
        kv_lens = [s.kv_len for s in self.seqs]
        lens = torch.tensor(kv_lens, device=device)
        self.past = max(kv_lens)
        self.reserve(len(self.seqs), self.past + 1)
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

"""The trainer's attention over packed micro-batches, and context parallelism (Ulysses).

A packed micro-batch holds several sequences one after another. Each attends causally to
itself only, so attention runs per sequence (`packed_attention`): one causal SDPA call
over each sequence's span, with no T x T mask. A mask would cost T^2 of memory per layer
(SDPA keeps its own float copy for backward in every layer, whatever the heads); the
spans cost nothing and skip the cross-sequence blocks' compute.

With context parallelism, the micro-batch is cut into `cp` equal, contiguous slices of
tokens, one per rank of the cp group; a sequence may cross a slice boundary. Everything
outside attention is per token, so each rank runs it on its own slice. Around attention:

  q, k, v  [1, heads, T/cp, d]  --all-to-all-->  [1, heads/cp, T, d]
  attention per sequence of the whole packed micro-batch, for heads/cp heads
  out      [1, heads/cp, T, d]  --all-to-all-->  [1, heads, T/cp, d]

Rotary embeddings are applied before attention from each token's own position id, which
every rank holds for its slice. The sequence spans come from the sequence ids of the
whole micro-batch, set for the duration of a forward with `micro_batch(...)`. The
all-to-alls are differentiable (their backward is the reverse all-to-all). So every
layer, every activation and the attention's saved q, k, v and output are split cp ways.

The implementation is registered with transformers as "areal_packed" and used by every
trainer model; transformers then builds no mask of its own. A forward outside
`micro_batch` (one unpacked sequence per row, no context parallelism) is causal per row.
cp must divide the local (after tensor parallelism) numbers of attention and of key/value
heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "areal_packed"


@dataclass
class _Context:
    group: Any
    size: int
    seq_ids: torch.Tensor  # [T]: the sequence of each token of the whole micro-batch
    _spans: list[tuple[int, int]] | None = None

    def spans(self) -> list[tuple[int, int]]:
        """[(start, end)] of each sequence in the whole micro-batch, computed once."""
        if self._spans is None:
            ids = self.seq_ids.cpu()
            starts = [0, *(torch.nonzero(ids[1:] != ids[:-1])[:, 0] + 1).tolist()]
            self._spans = list(zip(starts, [*starts[1:], len(ids)], strict=True))
        return self._spans


_current: _Context | None = None
_cp_size = 1  # of this process's trainer models (set by `register`)


@contextlib.contextmanager
def micro_batch(group: Any, size: int, seq_ids: torch.Tensor) -> Iterator[None]:
    """Forwards inside see the whole micro-batch's sequence ids (consecutive tokens of a
    sequence share one id); `size` is the cp size (1: no context parallelism)."""
    global _current
    previous, _current = _current, _Context(group, size, seq_ids)
    try:
        yield
    finally:
        _current = previous


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i.
    Differentiable: the backward is the same exchange in reverse."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_to_all_single(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def sequence_to_heads(x: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """[1, H, T/cp, d] (this rank's tokens, all heads) -> [1, H/cp, T, d]."""
    _, heads, length, dim = x.shape
    chunks = x.reshape(ctx.size, heads // ctx.size, length, dim)  # chunk i: heads for rank i
    got = _all_to_all(chunks, ctx.group)  # chunk i: rank i's tokens, my heads
    return got.permute(1, 0, 2, 3).reshape(1, heads // ctx.size, ctx.size * length, dim)


def heads_to_sequence(x: torch.Tensor, ctx: _Context) -> torch.Tensor:
    """[1, H/cp, T, d] -> [1, H, T/cp, d]: the inverse of `sequence_to_heads`."""
    _, local_heads, total, dim = x.shape
    length = total // ctx.size
    chunks = x.reshape(local_heads, ctx.size, length, dim).permute(1, 0, 2, 3)
    got = _all_to_all(chunks, ctx.group)  # chunk i: my tokens, rank i's heads
    return got.reshape(1, local_heads * ctx.size, length, dim)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: see the module docstring."""
    ctx = _current
    if ctx is None:
        if _cp_size > 1:
            raise RuntimeError("context-parallel attention outside `attention.micro_batch`")
        if attention_mask is not None:
            raise RuntimeError("the trainer's attention takes packed sequences, not a padding mask")
        spans = [(0, query.shape[2])]
    else:
        spans = ctx.spans()
    if ctx is not None and ctx.size > 1:
        query, key, value = (sequence_to_heads(t, ctx) for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    pieces = [
        F.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
        )
        for a, b in spans
    ]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    if ctx is not None and ctx.size > 1:
        out = heads_to_sequence(out, ctx)
    return out.transpose(1, 2).contiguous(), None


def register(cp_size: int) -> None:
    """Make "areal_packed" a transformers attention implementation (idempotent), for
    models whose ranks form context-parallel groups of `cp_size`."""
    from transformers import AttentionInterface

    global _cp_size
    _cp_size = cp_size
    AttentionInterface.register(ATTENTION, packed_attention)


def pad_to_multiple(n: int, size: int) -> int:
    """Tokens to append so that `n` splits into `size` equal slices."""
    return (-n) % size


def local_slice(n_padded: int, size: int, rank: int) -> slice:
    """This rank's tokens of a padded micro-batch."""
    length = n_padded // size
    return slice(rank * length, (rank + 1) * length)

"""Context parallelism as Ulysses sequence parallelism, for packed micro-batches.

Each packed micro-batch (several sequences, one after another) is cut into `cp` equal,
contiguous slices of tokens, one per rank of the cp group; a sequence may cross a slice
boundary. Everything outside attention is per token, so each rank runs it on its own
slice. Attention needs whole sequences, so around it (`ulysses_attention`):

  q, k, v  [1, heads, T/cp, d]  --all-to-all-->  [1, heads/cp, T, d]
  attention over the whole packed sequence for heads/cp heads (block-diagonal causal)
  out      [1, heads/cp, T, d]  --all-to-all-->  [1, heads, T/cp, d]

Rotary embeddings are applied before attention from each token's own position id, which
every rank holds for its slice. The block-diagonal mask comes from the sequence ids of
the whole micro-batch, set for the duration of a forward with `micro_batch(...)`. The
all-to-alls are differentiable (their backward is the reverse all-to-all).

The attention implementation is registered with transformers as "areal_ulysses"; with it
transformers builds no mask of its own. cp must divide the local (after tensor
parallelism) numbers of attention and of key/value heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "areal_ulysses"


@dataclass
class _Context:
    group: Any
    size: int
    seq_ids: torch.Tensor  # [T]: the sequence of each token of the whole micro-batch
    mask: torch.Tensor | None = None  # built by the first layer, shared by the others

    def attention_mask(self, device: torch.device) -> torch.Tensor:
        """[T, T] block-diagonal causal mask, built once per micro-batch: every layer
        saves the same tensor for backward instead of one T x T mask each."""
        if self.mask is None or self.mask.device != device:
            ids = self.seq_ids.to(device)
            causal = torch.ones(len(ids), len(ids), dtype=torch.bool, device=device).tril()
            self.mask = causal & (ids[:, None] == ids[None, :])
        return self.mask


_current: _Context | None = None


@contextlib.contextmanager
def micro_batch(group: Any, size: int, seq_ids: torch.Tensor) -> Iterator[None]:
    """Forwards inside see the whole micro-batch's sequence ids (for the mask)."""
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


def ulysses_attention(
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
        raise RuntimeError("context-parallel attention outside `context_parallel.micro_batch`")
    q, k, v = (sequence_to_heads(t, ctx) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    mask = ctx.attention_mask(q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return heads_to_sequence(out, ctx).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "areal_ulysses" a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)


def pad_to_multiple(n: int, size: int) -> int:
    """Tokens to append so that `n` splits into `size` equal slices."""
    return (-n) % size


def local_slice(n_padded: int, size: int, rank: int) -> slice:
    """This rank's tokens of a padded micro-batch."""
    length = n_padded // size
    return slice(rank * length, (rank + 1) * length)

"""The trainer's attention over packed micro-batches, and context parallelism (Ulysses).

A packed micro-batch holds several sequences one after another. Each attends causally to
itself only, so attention runs per sequence (`PackedAttention`), never with a T x T mask
(T^2 of memory per layer, and the cross-sequence blocks' compute). Each sequence is padded
to its own bucket width (its length rounded up to a multiple of BUCKET), and the sequences
of one bucket go through one SDPA call as a batch [n, heads, width, d] under a causal and
padding mask. A row's result then depends on its own length only, never on which other
sequences share its micro-batch, so 1, 2 and 3 ranks (which pack differently) compute the
same numbers. Padding costs less than BUCKET keys per query.

With context parallelism, the micro-batch is cut into `cp` equal, contiguous slices of
tokens, one per rank of the cp group; a sequence may cross a slice boundary. Everything
outside attention is per token, so each rank runs it on its own slice. Around attention:

  q, k, v  [1, heads, T/cp, d]  --all-to-all-->  [1, heads/cp, T, d]
  attention per sequence of the whole packed micro-batch, for heads/cp heads
  out      [1, heads/cp, T, d]  --all-to-all-->  [1, heads, T/cp, d]

Rotary embeddings are applied before attention from each token's own position id, which
every rank holds for its slice. The sequence spans come from the sequence ids of the
whole micro-batch, set for the duration of a forward with `PackedAttention.micro_batch`. The
all-to-alls are differentiable (their backward is the reverse all-to-all). So every
layer, every activation and the attention's saved q, k, v and output are split cp ways.

The implementation (a `PackedAttention`, which keeps the context parallel size and the
micro-batch of the forward running now) is installed in transformers as "areal_packed"
and used by every trainer model; transformers then builds no mask of its own. A forward
outside `micro_batch` (one unpacked sequence per row, no context parallelism) is causal
per row.
cp must divide the local (after tensor parallelism) numbers of attention and of key/value
heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "areal_packed"
# Sequences are padded to a multiple of this many tokens and attended in one SDPA call
# per width (`_bucket_attention`).
BUCKET = 16


@dataclass
class _Context:
    group: Any
    size: int
    seq_ids: torch.Tensor  # [T]: the sequence of each token of the whole micro-batch
    _spans: list[tuple[int, int]] | None = None
    _plans: dict[torch.device, list[_Bucket]] = field(default_factory=dict)

    def spans(self) -> list[tuple[int, int]]:
        """[(start, end)] of each sequence in the whole micro-batch, computed once (the
        trainer hands the sequence ids over on the host: no device sync)."""
        if self._spans is None:
            ids = self.seq_ids.cpu()
            starts = [0, *(torch.nonzero(ids[1:] != ids[:-1])[:, 0] + 1).tolist()]
            self._spans = list(zip(starts, [*starts[1:], len(ids)], strict=True))
        return self._spans

    def plan(self, device: torch.device) -> list[_Bucket]:
        """The buckets' index tensors on `device`, built at the first layer and reused by
        every other layer and by the backward's recompute."""
        if device not in self._plans:
            self._plans[device] = plan_buckets(self.spans(), device)
        return self._plans[device]


@dataclass(frozen=True)
class _Bucket:
    """The sequences of one padded width, as `_bucket_attention` gathers them: `index`
    [n, width] token positions (padding repeats a valid one), `mask` (None when no row is
    padded: plain causal attention), `keep` the flat [n * width] positions of the real
    rows, and `tokens` their positions in the micro-batch (None: every token, in order)."""

    index: torch.Tensor
    mask: torch.Tensor | None
    keep: torch.Tensor | None
    tokens: torch.Tensor | None


def plan_buckets(spans: list[tuple[int, int]], device: torch.device) -> list[_Bucket]:
    """Group `spans` by their width rounded up to BUCKET and build each group's index
    tensors on the host (from the spans, plain Python), copied to `device` once."""
    total = spans[-1][1] if spans else 0
    widths: dict[int, list[tuple[int, int]]] = {}
    for a, b in spans:
        widths.setdefault(-(-(b - a) // BUCKET) * BUCKET, []).append((a, b))
    buckets = []
    for width, chosen in widths.items():
        offsets = torch.arange(width)
        starts = torch.tensor([a for a, _ in chosen])
        lengths = torch.tensor([b - a for a, b in chosen])
        valid = offsets[None, :] < lengths[:, None]  # [n, width]
        index = (starts[:, None] + offsets[None, :]).clamp(max=max(total - 1, 0))
        padded = any(b - a != width for a, b in chosen)  # host arithmetic, no sync
        mask = keep = None
        if padded:
            tril = torch.ones(width, width, dtype=torch.bool).tril()
            mask = (tril[None, None] & valid[:, None, None, :]).to(device, non_blocking=True)
            keep = torch.nonzero(valid.reshape(-1))[:, 0].to(device, non_blocking=True)
        tokens = None
        if len(widths) > 1:
            tokens = torch.cat([torch.arange(a, b) for a, b in chosen]).to(device)
        buckets.append(_Bucket(index.to(device, non_blocking=True), mask, keep, tokens))
    return buckets


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i.
    Differentiable: the backward is the same exchange in reverse."""
    from areal_cli.trainer import collectives

    return collectives.all_to_all(x, group)


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


class PackedAttention:
    """The "areal_packed" attention of the trainer's models, with the state it needs: the
    context-parallel size of the models' ranks, and the micro-batch whose forward runs now
    (set by `micro_batch`). The trainer's mesh holds one (trainer.mesh.TrainerMesh); its
    `install` makes it the callable transformers runs for "areal_packed"."""

    def __init__(self, cp_size: int = 1) -> None:
        self.cp_size = cp_size
        self._current: _Context | None = None

    def install(self) -> PackedAttention:
        """Make this object transformers' "areal_packed" attention (the one every model
        with that implementation calls); returns it."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, self)
        return self

    @contextlib.contextmanager
    def micro_batch(self, group: Any, size: int, seq_ids: torch.Tensor) -> Iterator[None]:
        """Forwards inside see the whole micro-batch's sequence ids (consecutive tokens of
        a sequence share one id); `size` is the cp size (1: no context parallelism)."""
        previous, self._current = self._current, _Context(group, size, seq_ids)
        try:
            yield
        finally:
            self._current = previous

    def __call__(
        self,
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
        ctx = self._current
        if ctx is not None and module is not None:
            module._areal_packed_context = ctx  # for an activation checkpoint's recompute
        elif torch._C._current_graph_task_id() != -1:
            # Inside a backward: gradient checkpointing runs this forward again, after the
            # micro-batch's context was left; it must see the sequences the forward saw.
            ctx = getattr(module, "_areal_packed_context", None)
        if ctx is None:
            if self.cp_size > 1:
                raise RuntimeError(
                    "context-parallel attention outside `PackedAttention.micro_batch`"
                )
            if attention_mask is not None:
                raise RuntimeError(
                    "the trainer's attention takes packed sequences, not a padding mask"
                )
            buckets = plan_buckets([(0, query.shape[2])], query.device)
        else:
            buckets = ctx.plan(query.device)
        if ctx is not None and ctx.size > 1:
            query, key, value = (sequence_to_heads(t, ctx) for t in (query, key, value))
        groups = query.shape[1] // key.shape[1]
        if buckets[0].tokens is None:  # one bucket: every sequence, in token order
            out = _bucket_attention(query, key, value, buckets[0], groups, dropout, scaling)
        else:
            out = torch.empty_like(query)
            for bucket in buckets:
                rows = _bucket_attention(query, key, value, bucket, groups, dropout, scaling)
                out = out.index_copy(2, bucket.tokens, rows)
        if ctx is not None and ctx.size > 1:
            out = heads_to_sequence(out, ctx)
        return out.transpose(1, 2).contiguous(), None


def _bucket_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bucket: _Bucket,
    groups: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of one bucket's sequences of [1, H, T, d], each padded to the
    bucket's width, in one SDPA call on [n, H, width, d]; returns [1, H, sum of lengths,
    d], the real rows in span order. Without padding the call is a plain causal one;
    otherwise a mask also hides each row's padding keys (a padding query still sees key 0,
    so no row is all -inf). Everything it indexes with was planned before the forward
    (`plan_buckets`): no host sync here.

    Grouped-query attention (`groups` query heads per key/value head): SDPA's own
    `enable_gqa` where it reads K and V in place (causal, unmasked; and on the CPU),
    else the key/value heads are repeated as before (a masked CUDA call would otherwise
    leave the memory-efficient kernel, which has no grouped mode, for the math one)."""
    n, width = bucket.index.shape

    def rows(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, d] -> [n, H, width, d]
        return x[0][:, bucket.index].transpose(0, 1)

    gqa = groups > 1 and (bucket.mask is None or query.device.type == "cpu")
    if groups > 1 and not gqa:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        rows(query),
        rows(key),
        rows(value),
        attn_mask=bucket.mask,
        dropout_p=dropout,
        is_causal=bucket.mask is None,
        scale=scaling,
        enable_gqa=gqa,
    )  # [n, H, width, d]
    if bucket.keep is None:
        return out.transpose(0, 1).reshape(1, out.shape[1], n * width, out.shape[3])
    flat = out.transpose(0, 1).reshape(out.shape[1], n * width, out.shape[3])
    return flat.index_select(1, bucket.keep)[None]


def register(cp_size: int = 1) -> PackedAttention:
    """A new PackedAttention for models whose ranks form context-parallel groups of
    `cp_size`, installed as transformers' "areal_packed"."""
    return PackedAttention(cp_size).install()


def installed() -> PackedAttention:
    """The PackedAttention transformers runs for "areal_packed" now: the one the trainer's
    models call (a new one for cp 1 when none is installed). For a step without a mesh."""
    from transformers import AttentionInterface

    found = AttentionInterface._global_mapping.get(ATTENTION)
    return found if isinstance(found, PackedAttention) else register(1)


def pad_to_multiple(n: int, size: int) -> int:
    """Tokens to append so that `n` splits into `size` equal slices."""
    return (-n) % size


def local_slice(n_padded: int, size: int, rank: int) -> slice:
    """This rank's tokens of a padded micro-batch."""
    length = n_padded // size
    return slice(rank * length, (rank + 1) * length)

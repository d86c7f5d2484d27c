"""Pack variable-length sequences into padding-free micro-batches.

A micro-batch is one 1-D concatenation of whole sequences with ``position_ids`` restarting at 0
per sequence and ``cu_seqlens`` (cumulative lengths, ``[0, l0, l0+l1, ...]``) marking boundaries.
HF causal LMs in recent transformers (``masking_utils``; checked with 5.x) derive a block-diagonal causal
mask from such ``position_ids`` *only* when ``attention_mask is None`` and no KV cache exists, so
the forward must pass ``use_cache=False`` (see :func:`packed_forward_kwargs`): with the default
``use_cache=True`` the sequences silently attend to each other. Verified equal to per-sequence
forwards within 1e-5 on a small fp32 Llama with CPU sdpa and eager attention (tests/unit/test_packing.py).

Per-token side tensors (loss mask, behaviour logprobs, ...) are packed with ``torch.cat`` over the
same sequence order as :func:`pack_sequences`, and split back with :func:`unpack`.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatchPlan:
    """Assignment of sequences to micro-batches.

    ``mbs[k]`` lists the sequence indices of micro-batch k in ascending order; ``tokens_per_mb[k]``
    is its packed length. ``padding_fraction`` is the share of slots that would be padding if each
    micro-batch were laid out padded as ``[len(mbs[k]), longest in mbs[k]]``; the packed layout
    itself has none, so it measures what packing saves (or costs, on a padded fallback).
    """

    mbs: list[list[int]]
    tokens_per_mb: list[int]
    padding_fraction: float


@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch: ``input_ids``/``position_ids``/``seq_ids`` are ``[T]``, ``cu_seqlens`` ``[n+1]``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_ids: torch.Tensor
    max_seqlen: int


def padding_fraction(seqlens: Sequence[int], mbs: Sequence[Sequence[int]]) -> float:
    """``1 - sum(l_i) / sum_k |mb_k| * max_{i in mb_k} l_i`` (0 for no tokens)."""
    slots = sum(len(mb) * max(seqlens[i] for i in mb) for mb in mbs if mb)
    tokens = sum(seqlens[i] for mb in mbs for i in mb)
    return 0.0 if slots == 0 else 1.0 - tokens / slots


def plan_micro_batches(
    seqlens: Sequence[int], max_tokens_per_mb: int, n_mbs: int = 1
) -> MicroBatchPlan:
    """Balanced, deterministic packing of sequences into micro-batches of <= ``max_tokens_per_mb`` tokens.

    Algorithm (longest-processing-time with a capacity): open
    ``k = max(n_mbs - n_long, ceil(sum(fitting lengths) / max_tokens_per_mb))`` bins (capped at
    the number of fitting sequences, so no bin is empty), then place sequences longest first
    (ties by index) into the least-filled bin that still fits, opening a new bin when none does.
    A sequence longer than ``max_tokens_per_mb`` cannot be split (attention spans it), so it gets
    a micro-batch of its own, the only way the bound is exceeded. ``n_mbs`` is a minimum number
    of micro-batches, reached only if there are at least that many sequences.
    """
    if max_tokens_per_mb < 1:
        raise ValueError(f"max_tokens_per_mb must be >= 1, got {max_tokens_per_mb}")
    if n_mbs < 1:
        raise ValueError(f"n_mbs must be >= 1, got {n_mbs}")
    if any(n < 0 for n in seqlens):
        raise ValueError("sequence lengths must be >= 0")
    order = sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i))
    long_ids = [i for i in order if seqlens[i] > max_tokens_per_mb]
    fit_ids = [i for i in order if seqlens[i] <= max_tokens_per_mb]
    bins = _fill_bins(seqlens, fit_ids, max_tokens_per_mb, n_mbs - len(long_ids))
    mbs = [[i] for i in long_ids] + [sorted(b) for b in bins]
    return MicroBatchPlan(
        mbs=mbs,
        tokens_per_mb=[sum(seqlens[i] for i in mb) for mb in mbs],
        padding_fraction=padding_fraction(seqlens, mbs),
    )


def _fill_bins(
    seqlens: Sequence[int], ids_longest_first: list[int], cap: int, min_bins: int
) -> list[list[int]]:
    """Least-filled-bin-that-fits placement of already sorted sequences."""
    if not ids_longest_first:
        return []
    total = sum(seqlens[i] for i in ids_longest_first)
    k = min(max(min_bins, math.ceil(total / cap), 1), len(ids_longest_first))
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in ids_longest_first:
        # Ties on load go to the lowest bin index, which keeps the plan deterministic.
        fitting = [b for b in range(len(bins)) if loads[b] + seqlens[i] <= cap]
        if fitting:
            b = min(fitting, key=lambda j: (loads[j], j))
        else:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += seqlens[i]
    return bins


def cu_seqlens_from_lengths(
    lengths: Sequence[int], device: torch.device | None = None
) -> torch.Tensor:
    """``[0, l0, l0+l1, ..., sum l]`` as int32 (the dtype flash-attention kernels expect)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``seq_ids[t] = s`` for ``cu_seqlens[s] <= t < cu_seqlens[s+1]``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``position_ids[t] = t - cu_seqlens[s]`` for the sequence s holding t (restarts at 0)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def pack_sequences(seqs: Sequence[torch.Tensor]) -> PackedBatch:
    """Concatenate 1-D token sequences into one packed micro-batch (order preserved)."""
    if not seqs:
        raise ValueError("cannot pack zero sequences")
    lengths = [int(s.numel()) for s in seqs]
    cu = cu_seqlens_from_lengths(lengths, device=seqs[0].device)
    return PackedBatch(
        input_ids=torch.cat([s.reshape(-1) for s in seqs]),
        position_ids=position_ids_from_cu_seqlens(cu),
        cu_seqlens=cu,
        seq_ids=seq_ids_from_cu_seqlens(cu),
        max_seqlen=max(lengths),
    )


def unpack(values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed ``[T, ...]`` tensor back into per-sequence tensors."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(values, lengths, dim=0))


def packed_forward_kwargs(batch: PackedBatch) -> dict[str, torch.Tensor | bool]:
    """Keyword arguments for an HF causal LM forward over a packed batch (batch dim 1, no cache, no mask)."""
    # use_cache=False is load-bearing: with a cache transformers skips packed-sequence detection.
    return {
        "input_ids": batch.input_ids.unsqueeze(0),
        "position_ids": batch.position_ids.unsqueeze(0),
        "use_cache": False,
    }


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on CUDA it goes through
    pinned memory with a non-blocking copy (a copy from pageable memory waits for the
    stream); elsewhere a plain `.to`."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

"""The trainer's packed attention: sequences padded to buckets and attended one SDPA call
per bucket give the same outputs and gradients as one exact causal call per sequence, and
a sequence's result does not depend on the other sequences of its micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_cli.trainer import attention


def _attend(q, k, v, lengths: list[int]) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    packed = attention.PackedAttention()
    with packed.micro_batch(None, 1, ids):
        out, _ = packed(None, q, k, v, None, scaling=0.25)
    return out


def _reference(q, k, v, lengths: list[int]) -> torch.Tensor:
    """One exact causal call per sequence, grouped-query heads repeated."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    pieces, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        pieces.append(
            F.scaled_dot_product_attention(
                q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True, scale=0.25
            )
        )
        start += n
    return torch.cat(pieces, dim=2).transpose(1, 2)


def _tensors(total: int, dtype=torch.float64) -> list[torch.Tensor]:
    shapes = [(1, 4, total, 8), (1, 2, total, 8), (1, 2, total, 8)]  # grouped-query k, v
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("lengths", [[5, 3, 7, 1, 6], [16] * 8, [2, 40, 3], [33], [16, 17, 32, 1]])
def test_buckets_equal_one_call_per_sequence(lengths: list[int]) -> None:
    torch.manual_seed(0)
    total = sum(lengths)
    tensors = _tensors(total)
    results = []
    for fn in (_attend, _reference):
        out = fn(*tensors, lengths)
        grads = torch.autograd.grad((out * out.detach().cos()).sum(), tensors)
        results.append((out.detach(), grads))
    (out_a, grads_a), (out_b, grads_b) = results
    assert out_a.shape == (1, total, 4, 8)
    torch.testing.assert_close(out_a, out_b, rtol=1e-10, atol=1e-10)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-10)


def test_a_sequence_is_computed_the_same_whatever_shares_its_micro_batch() -> None:
    """fp32, bit for bit: ranks that pack the same sequence with different neighbours
    (1, 2 or 3 ranks) must compute the same numbers for it."""
    torch.manual_seed(1)
    q, k, v = (t.detach() for t in _tensors(60, torch.float32))
    alone = _attend(q[:, :, :11], k[:, :, :11], v[:, :, :11], [11])
    for lengths in ([11, 5, 9], [11, 30, 14, 5], [11] * 5):
        total = sum(lengths)
        out = _attend(q[:, :, :total], k[:, :, :total], v[:, :, :total], lengths)
        assert torch.equal(out[:, :11], alone)


def test_gradient_checkpointing_recomputes_with_the_micro_batch_of_the_forward() -> None:
    """With activation checkpointing the forward runs again inside the backward, after the
    micro-batch's context was left (the trainer calls backward outside it). The recompute
    must attend per sequence as the forward did: same gradients as without checkpointing
    (it once raised CheckpointError, or would have attended across sequences)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(2)
    lengths = [5, 19, 3]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    packed = attention.PackedAttention()
    layer = torch.nn.Module()  # the attention module transformers passes

    def block(q, k, v):
        out, _ = packed(layer, q.sin(), k, v, None, scaling=0.25)
        return out

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(2)
        tensors = _tensors(sum(lengths))
        with packed.micro_batch(None, 1, ids):
            if checkpointed:
                out = checkpoint(block, *tensors, use_reentrant=False)
            else:
                out = block(*tensors)
        (out * out.detach().cos()).sum().backward()  # outside the context, as the trainer
        grads.append([t.grad for t in tensors])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, recomputed, rtol=1e-12, atol=1e-12)


def test_the_forward_and_backward_read_nothing_back_from_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every index the attention needs is planned from the sequence ids on the host, once
    per micro-batch (`_Context.plan`, reused by every layer): the forward and backward
    never read a tensor's value on the host (`bool`, `item`, `tolist`, `cpu`: a device
    sync per layer on a GPU). Those are made to fail once the plan exists."""
    torch.manual_seed(0)
    lengths = [5, 3, 7, 1, 6, 16]
    q, k, v = _tensors(sum(lengths))
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    packed = attention.PackedAttention()
    with packed.micro_batch(None, 1, ids):
        packed._current.plan(q.device)  # what the first layer does

        def refuse(self, *args, **kwargs):
            raise AssertionError("a host read of a tensor inside the attention")

        for name in ("__bool__", "item", "tolist", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
        out, _ = packed(None, q, k, v, None, scaling=0.25)
        out2, _ = packed(None, q, k, v, None, scaling=0.25)  # a second layer: the same plan
        (out * out2).sum().backward()
    monkeypatch.undo()
    torch.testing.assert_close(out, _reference(q, k, v, lengths), rtol=1e-10, atol=1e-10)

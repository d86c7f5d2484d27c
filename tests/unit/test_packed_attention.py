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


def _stand_in(causal_key: str, seen: list[dict]):
    """A CPU stand-in for torch's varlen kernel (FlashAttention runs on CUDA only): it
    checks what it is given as the real signature takes it, and computes per-sequence
    SDPA (`attention.sequence_attention`). Tests the packing around the kernel (layouts,
    cumulative lengths, grouped heads, the causal keyword), not the kernel."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False, **kw):
        assert q.dim() == 3 and q.is_contiguous() and cu_q.dtype == torch.int32
        assert torch.equal(cu_q, cu_k) and max_q == max_k
        assert kw == (
            {"window_size": (-1, 0)} if causal_key == "window_size" else {"is_causal": True}
        )
        bounds = cu_q.tolist()
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        assert max_q == max(b - a for a, b in spans)
        seen.append({"spans": spans, "gqa": enable_gqa})
        return attention.sequence_attention(q, k, v, spans, scale)

    params = {"window_size": (-1, 0)} if causal_key == "window_size" else {"is_causal": True}
    return lambda: (varlen_attn, params, causal_key == "window_size")


@pytest.mark.parametrize("causal_key", ["window_size", "is_causal"])
@pytest.mark.parametrize("lengths", [[5, 3, 7, 1, 6], [16] * 4, [33]])
def test_varlen_path_equals_one_call_per_sequence(causal_key, lengths, monkeypatch) -> None:
    """The varlen kernel's path (CUDA in bf16/fp16 under auto) gets [T, H, d] with the
    micro-batch's cumulative lengths and returns what per-sequence causal attention gives,
    gradients included; both signatures torch has had (window_size, is_causal) work."""
    seen: list[dict] = []
    monkeypatch.setattr(attention, "_varlen_kernel", _stand_in(causal_key, seen))
    torch.manual_seed(0)
    tensors = _tensors(sum(lengths))
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    packed = attention.PackedAttention(kernel="varlen")
    with packed.micro_batch(None, 1, ids, torch.device("cpu")) as _:
        assert packed._current._bounds and not packed._current._plans  # planned on entry
        out, _ = packed(None, *tensors, None, scaling=0.25)
    grads = torch.autograd.grad((out * out.detach().cos()).sum(), tensors)
    ref = _reference(*tensors, lengths)
    ref_grads = torch.autograd.grad((ref * ref.detach().cos()).sum(), tensors)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert seen[0]["spans"] == list(zip(bounds[:-1], bounds[1:], strict=True))
    assert seen[0]["gqa"] is (causal_key == "window_size")  # 4 query heads over 2
    assert packed.used == {"varlen"}


def test_auto_takes_buckets_on_the_cpu_and_plans_them_on_entry() -> None:
    packed = attention.PackedAttention(kernel="auto")
    ids = torch.tensor([0, 0, 1, 1, 1])
    with packed.micro_batch(None, 1, ids, torch.device("cpu")):
        assert packed._current._plans and not packed._current._bounds
        q, k, v = _tensors(5)
        packed(None, q, k, v, None)
    assert packed.used == {"buckets"}


def test_the_varlen_probe_says_why_not(monkeypatch) -> None:
    """On a CPU torch's kernel is missing, and a kernel that computes something else
    (here: attention across the whole pack) is caught by the probe's comparison."""
    cpu = torch.device("cpu")
    problem = attention.varlen_problem(cpu, torch.bfloat16, 4, 2, 16)
    assert problem is not None and "NotImplementedError" in problem

    def across_the_pack(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        return attention.sequence_attention(q, k, v, [(0, q.shape[0])], scale)

    monkeypatch.setattr(
        attention, "_varlen_kernel", lambda: (across_the_pack, {"window_size": (-1, 0)}, True)
    )
    problem = attention.varlen_problem(cpu, torch.float32, 4, 2, 16)
    assert problem is not None and "differs from per-sequence SDPA" in problem
    monkeypatch.setattr(attention, "_varlen_kernel", _stand_in("window_size", []))
    assert attention.varlen_problem(cpu, torch.float32, 4, 2, 16) is None
    with torch.inference_mode():  # a first forward without autograd still probes it
        assert attention.varlen_problem(cpu, torch.float32, 4, 2, 16) is None


def test_the_varlen_probe_inside_a_checkpointed_layer_leaves_the_checkpoint_alone(
    monkeypatch,
) -> None:
    """The probe runs at the first layer's first forward, which may be inside gradient
    checkpointing (non-reentrant: it packs every tensor saved in the forward). The
    probe's own saved tensors must not be packed with the layer's: the recompute (which
    does not probe again) would then not line up with them."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(attention, "_varlen_kernel", _stand_in("window_size", []))
    cpu = torch.device("cpu")
    probed: list[str | None] = []

    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not probed:  # as PackedAttention._use_varlen: once per process and shape
            probed.append(attention.varlen_problem(cpu, torch.float32, 4, 2, 16))
        return (x @ w).tanh() @ w.T

    torch.manual_seed(0)
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    out = checkpoint(layer, x, w, use_reentrant=False)
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    ref = torch.autograd.grad(layer(x, w).square().sum(), (x, w))
    assert probed == [None]
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_kernel_variable_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(attention.KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match="AREAL_TRAINER_ATTENTION='flash'"):
        attention.PackedAttention()
    monkeypatch.setenv(attention.KERNEL_ENV, "buckets")
    assert attention.PackedAttention().kernel == "buckets"


@pytest.mark.slow
def test_compiled_layers_equal_eager_ones() -> None:
    """actor.compile's `compile_blocks` on our decoder with the packed attention: dynamo
    compiles the layers (graphs around the eager attention), and a forward and backward
    over two packed micro-batches of different lengths give eager's numbers."""
    import copy

    import torch._dynamo

    from areal_cli.models.decoder import DecoderConfig, DecoderLM
    from areal_cli.trainer.parallelize import compile_blocks

    cfg = DecoderConfig.from_dict(
        {
            "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128,
        }
    )  # fmt: skip
    torch.manual_seed(0)
    eager = DecoderLM(cfg).float()
    packed = attention.PackedAttention()
    eager.attention = packed
    compiled = copy.deepcopy(eager)
    compiled.attention = packed
    compile_blocks(compiled, list(compiled.model.layers))
    torch._dynamo.utils.counters.clear()
    for lengths in ([5, 9, 3], [17, 2]):
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        tokens = torch.randint(0, 64, (1, len(ids)))
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            with packed.micro_batch(None, 1, ids, torch.device("cpu")):
                logits = model(input_ids=tokens, position_ids=positions).logits
            logits.square().mean().backward()
            outs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2

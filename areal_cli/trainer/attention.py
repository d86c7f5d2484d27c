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

Two kernels compute the same thing (`PackedAttention.kernel`; the environment variable
AREAL_TRAINER_ATTENTION=auto|varlen|buckets picks one, auto by default):
- buckets (above): SDPA per padded width. The CPU path, and the fallback everywhere.
- varlen: FlashAttention over the packed [T, heads, d] itself (`torch.nn.attention.varlen`),
  given the micro-batch's cumulative sequence lengths: no padding, no mask, grouped
  key/value heads read in place. auto takes it on CUDA in bf16/fp16 once a probe
  (`varlen_problem`: a small forward and backward against per-sequence SDPA in float32)
  has passed on that device, dtype and head shape; otherwise, or if the probe fails
  (torch without varlen, another signature, a kernel error), buckets, said once on stderr.
Whatever a kernel indexes with (bucket index tensors, or cu_seqlens) is planned on the
host when the micro-batch is entered with its device (`micro_batch(..., device=)`) and
copied over without waiting: nothing in the forward or backward reads a device value back.

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
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from areal_cli.trainer.packing import to_device

ATTENTION = "areal_packed"
# Sequences are padded to a multiple of this many tokens and attended in one SDPA call
# per width (`_bucket_attention`).
BUCKET = 16
KERNEL_ENV = "AREAL_TRAINER_ATTENTION"
KERNELS = ("auto", "varlen", "buckets")
_HALF = (torch.bfloat16, torch.float16)


def kernel_choice(given: str | None = None) -> str:
    """`given`, else the kernel AREAL_TRAINER_ATTENTION asks for (auto when unset); one of
    KERNELS, or a ValueError that names where the value came from."""
    value = given if given is not None else os.environ.get(KERNEL_ENV) or "auto"
    if value not in KERNELS:
        where = f"{KERNEL_ENV}={value!r}" if given is None else f"attention kernel {value!r}"
        raise ValueError(f"{where}: use one of {', '.join(KERNELS)}")
    return value


@dataclass
class _Context:
    group: Any
    size: int
    seq_ids: torch.Tensor  # [T]: the sequence of each token of the whole micro-batch
    _spans: list[tuple[int, int]] | None = None
    _plans: dict[torch.device, list[_Bucket]] = field(default_factory=dict)
    _bounds: dict[torch.device, tuple[torch.Tensor, int]] = field(default_factory=dict)

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

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(int32 [n + 1] cumulative sequence lengths on `device`, the longest sequence):
        what the varlen kernel takes, built once like `plan`."""
        if device not in self._bounds:
            self._bounds[device] = cu_seqlens(self.spans(), device)
        return self._bounds[device]


def cu_seqlens(spans: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, int]:
    """`spans` as varlen attention takes them: int32 [0, end_0, end_1, ...] on `device`,
    and the longest span (host arithmetic)."""
    bounds = torch.tensor([0, *(b for _, b in spans)], dtype=torch.int32)
    return to_device(bounds, device), max((b - a for a, b in spans), default=0)


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
            mask = to_device(tril[None, None] & valid[:, None, None, :], device)
            keep = to_device(torch.nonzero(valid.reshape(-1))[:, 0], device)
        tokens = None
        if len(widths) > 1:
            tokens = to_device(torch.cat([torch.arange(a, b) for a, b in chosen]), device)
        buckets.append(_Bucket(to_device(index, device), mask, keep, tokens))
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
    context-parallel size of the models' ranks, the kernel (`KERNELS`: auto, varlen or
    buckets; default from AREAL_TRAINER_ATTENTION), and the micro-batch whose forward runs
    now (set by `micro_batch`). The trainer's mesh holds one (trainer.mesh.TrainerMesh);
    its `install` makes it the callable transformers runs for "areal_packed"."""

    def __init__(self, cp_size: int = 1, kernel: str | None = None) -> None:
        self.cp_size = cp_size
        self.kernel = kernel_choice(kernel)
        self._current: _Context | None = None
        # auto: per (device, dtype, heads, kv heads, head dim), whether varlen passed its probe
        self._varlen_ok: dict[tuple, bool] = {}
        self.used: set[str] = set()  # the kernels that ran (for benchmarks and checks)

    def install(self) -> PackedAttention:
        """Make this object transformers' "areal_packed" attention (the one every model
        with that implementation calls); returns it."""
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, self)
        return self

    def prepare(
        self, group: Any, size: int, seq_ids: torch.Tensor, device: torch.device | None = None
    ) -> _Context:
        """A micro-batch's context: the whole micro-batch's sequence ids (consecutive
        tokens of a sequence share one id, on the host); `size` is the cp size (1: no
        context parallelism). With the model's `device`, what the kernel indexes with is
        planned and sent there now, so the forward reads nothing back from the device."""
        ctx = _Context(group, size, seq_ids)
        if device is not None:
            if self._may_use_varlen(device):
                ctx.cu_seqlens(device)
            else:
                ctx.plan(device)
        return ctx

    @contextlib.contextmanager
    def running(self, ctx: _Context) -> Iterator[None]:
        """Forwards inside attend within the sequences of `ctx` (from `prepare`)."""
        previous, self._current = self._current, ctx
        try:
            yield
        finally:
            self._current = previous

    def micro_batch(
        self, group: Any, size: int, seq_ids: torch.Tensor, device: torch.device | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """`running(prepare(...))`: forwards inside see this micro-batch's sequences."""
        return self.running(self.prepare(group, size, seq_ids, device))

    def _may_use_varlen(self, device: torch.device) -> bool:
        """Whether a forward on `device` is expected to take varlen (the dtype and the
        probe decide at the first layer; a wrong guess only moves planning there)."""
        if self.kernel != "auto":
            return self.kernel == "varlen"
        return device.type == "cuda" and all(self._varlen_ok.values())

    def _use_varlen(self, query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
        if self.kernel != "auto":
            return self.kernel == "varlen"
        if dropout or query.device.type != "cuda" or query.dtype not in _HALF:
            return False
        shape = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[3])
        if shape not in self._varlen_ok:
            from areal_cli.trainer import collectives

            problem = varlen_problem(*shape)
            self._varlen_ok[shape] = problem is None
            if problem is not None:
                collectives.note(
                    f"packed attention: varlen unavailable ({problem}); using SDPA per "
                    f"padded width. {KERNEL_ENV}=buckets skips this check."
                )
            else:
                dtype = str(query.dtype).removeprefix("torch.")
                collectives.note(f"packed attention: varlen (FlashAttention) in {dtype}")
        return self._varlen_ok[shape]

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
            ctx = _Context(None, 1, torch.zeros(query.shape[2], dtype=torch.long))
        split = ctx.size > 1
        if split:
            query, key, value = (sequence_to_heads(t, ctx) for t in (query, key, value))
        if self._use_varlen(query, key, dropout):
            self.used.add("varlen")
            bounds, longest = ctx.cu_seqlens(query.device)
            out = varlen_attention(query, key, value, bounds, longest, scaling)  # [T, H, d]
            if not split:
                return out[None], None
            out = out.transpose(0, 1)[None]
        else:
            self.used.add("buckets")
            out = _buckets_attention(query, key, value, ctx.plan(query.device), dropout, scaling)
        if split:
            out = heads_to_sequence(out, ctx)
        return out.transpose(1, 2).contiguous(), None


def _buckets_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    buckets: list[_Bucket],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of [1, H, T, d] per bucket (`_bucket_attention`), back in token order."""
    groups = query.shape[1] // key.shape[1]
    if buckets[0].tokens is None:  # one bucket: every sequence, in token order
        return _bucket_attention(query, key, value, buckets[0], groups, dropout, scaling)
    out = torch.empty_like(query)
    for bucket in buckets:
        rows = _bucket_attention(query, key, value, bucket, groups, dropout, scaling)
        out = out.index_copy(2, bucket.tokens, rows)
    return out


def _varlen_kernel() -> tuple[Callable[..., torch.Tensor], dict[str, Any], bool]:
    """torch's varlen attention, the keyword that makes it causal (newer torch: window
    (-1, 0); older: is_causal), and whether it takes enable_gqa (without it, grouped
    key/value heads go to FlashAttention as they are, which reads them natively)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        raise ImportError("its varlen_attn takes neither window_size nor is_causal")
    return varlen_attn, causal, "enable_gqa" in params


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    longest: int,
    scaling: float | None,
    kernel: Callable[[], tuple[Callable[..., torch.Tensor], dict[str, Any], bool]] | None = None,
) -> torch.Tensor:
    """Causal attention of the packed sequences of [1, H, T, d] (`bounds`: int32 [n + 1]
    cumulative lengths; `longest`: the longest sequence) in one varlen call on [T, H, d];
    returns [T, H, d]."""
    attend, causal, takes_gqa = (kernel or _varlen_kernel)()
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    extra = dict(causal, scale=scaling)
    if takes_gqa and k.shape[1] != q.shape[1]:
        extra["enable_gqa"] = True
    return attend(q, k, v, bounds, bounds, longest, longest, **extra)


def sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[tuple[int, int]],
    scaling: float | None,
) -> torch.Tensor:
    """The reference: causal SDPA of each span of [T, H, d] alone; returns [T, H, d]."""
    parts = []
    for a, b in spans:
        q, k, v = (x[a:b].transpose(0, 1)[None] for x in (query, key, value))
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1
        )
        parts.append(out[0].transpose(0, 1))
    return torch.cat(parts)


def varlen_error(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> float:
    """How far the varlen kernel on `device` in `dtype` is from `sequence_attention` in
    float32, for two sequences of 7 and 17 tokens of this head shape: the larger of the
    output's max |difference| and the query gradient's, relative to its largest value.
    Raises whatever the kernel raises."""
    spans = [(0, 7), (7, 24)]
    g = torch.Generator().manual_seed(0)
    # Gradients even when the first forward runs under no_grad or inference_mode; the
    # probe's saved tensors kept as they are (the innermost hooks win), not packed into a
    # gradient checkpoint around the layer that probes, whose recompute does not probe.
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with torch.inference_mode(False), torch.enable_grad(), keep:
        host = [torch.randn(24, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
        # copies (`.to` may return the tensor itself): the two passes keep apart gradients
        q, k, v = (x.to(device, dtype).clone().requires_grad_() for x in host)
        bounds, longest = cu_seqlens(spans, device)
        out = varlen_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), bounds, longest, None)
        out.float().square().sum().backward()
        ref_q = host[0].to(device).clone().requires_grad_()
        ref = sequence_attention(ref_q, host[1].to(device), host[2].to(device), spans, None)
        ref.square().sum().backward()
    out, ref = out.detach(), ref.detach()  # the comparison records no graph either
    return max(
        float((out.float() - ref).abs().max()),
        float((q.grad.float() - ref_q.grad).abs().max() / ref_q.grad.abs().max()),
    )


VARLEN_TOLERANCE = 0.05  # bf16 rounding is ~1e-2 here; a wrong mask or layout is ~1


def varlen_problem(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> str | None:
    """None when the varlen kernel runs here and passes `varlen_error` within
    VARLEN_TOLERANCE; otherwise why not, in a few words."""
    try:
        error = varlen_error(device, dtype, heads, kv_heads, dim)
    except Exception as exc:  # noqa: BLE001 - any failure means: not this kernel here
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first[:160]}"
    if not error <= VARLEN_TOLERANCE:
        return f"it differs from per-sequence SDPA by {error:.3g} (tolerance {VARLEN_TOLERANCE})"
    return None


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

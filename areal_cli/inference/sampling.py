"""Scheduler-side sequence state and token sampling.

Logprob convention: for a sampled token the engine returns its log-probability under the
temperature-scaled full softmax, `log_softmax(logits / T)`, taken before top-k/top-p
truncation (truncation only restricts which tokens can be drawn). That is what a trainer
recomputes from the same logits. Greedy requests (temperature 0) report `log_softmax(logits)`.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_cli.inference.api import GenerateOutput, GenerateRequest, SamplingParams


@dataclass(eq=False)
class SeqState:
    """Scheduler-side state of one request."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    seed: int  # signed 64-bit; the token at output index n draws counter_uniforms(seed, n)
    future: concurrent.futures.Future[GenerateOutput]
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_request(
        cls,
        request: GenerateRequest,
        tokenizer: Any,
        vocab_size: int,
        context_length: int,
        seed_rng: random.Random,
    ) -> SeqState:
        """Validate and tokenise a request; a request without a seed draws one from
        `seed_rng`."""
        if (request.input_ids is None) == (request.text is None):
            raise ValueError("give exactly one of input_ids or text")
        ids = request.input_ids
        if ids is None:
            ids = tokenizer(request.text)["input_ids"]
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        if len(ids) >= context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {context_length}"
            )
        params = request.sampling_params
        params.validate()
        seed = params.sampling_seed
        if seed is None:
            seed = seed_rng.getrandbits(63)
        future: concurrent.futures.Future[GenerateOutput] = concurrent.futures.Future()
        # RUNNING futures cannot be cancelled, so only the scheduler ever resolves them.
        future.set_running_or_notify_cancel()
        return cls(
            rid=request.rid or uuid.uuid4().hex,
            prompt_ids=ids,
            params=params,
            return_logprob=request.return_logprob,
            seed=signed64(int(seed)),
            future=future,
        )

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


def truncation_mask(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Boolean mask [R, V] (vocabulary order) of the tokens that survive top-k then top-p,
    for all rows at once on their device, with per-row settings (top_k <= 0 or >= V: off;
    top_p 1: off). Top-k keeps every token at least as likely as the k-th (ties
    included); top-p then keeps the most likely of those until their mass reaches top_p (a
    token is dropped when the mass before it already does). The settings are host lists,
    so choosing what to run reads nothing back from the device. Rows with top-k sort only
    their k most likely tokens (one `topk`); rows with top-p alone sort the vocabulary."""
    vocab = probs.shape[-1]
    # rows with top_p 1 keep everything: rounding in a running sum must not drop a tail
    caps = [p if p < 1.0 else float("inf") for p in top_p]
    keep = torch.ones_like(probs, dtype=torch.bool)
    windowed = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    whole = [i for i, k in enumerate(top_k) if not 0 < k < vocab and top_p[i] < 1.0]
    if windowed:
        keep[windowed] = _top_k_then_p(
            probs[windowed], [top_k[i] for i in windowed], [caps[i] for i in windowed]
        )
    if whole:
        ranked, order = torch.sort(probs[whole], dim=-1, descending=True)
        drop = (torch.cumsum(ranked, dim=-1) - ranked) >= _column(probs, [caps[i] for i in whole])
        keep[whole] = ~torch.zeros_like(drop).scatter_(1, order, drop)
    return keep


def _put(out: torch.Tensor, index: list[int], values: torch.Tensor, rows: int) -> None:
    """out[index] = values; a plain copy when `index` is every row."""
    if len(index) == rows:
        out.copy_(values)
    else:
        out[index] = values


def _column(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _top_k_then_p(probs: torch.Tensor, ks: list[int], caps: list[float]) -> torch.Tensor:
    """`truncation_mask` for rows that all have top-k: top-p runs over the `topk` window
    (sorted already). Tokens tied with the k-th beyond the window come after all of it in
    the order; they are dropped when the window's kept mass already reaches top_p."""
    widest = max(ks)
    values, order = torch.topk(probs, widest, dim=-1)  # [R, widest], descending
    kth = values.gather(1, torch.tensor(ks, device=probs.device)[:, None] - 1)
    keep = probs >= kth
    if all(c == float("inf") for c in caps):
        return keep
    cap = _column(probs, caps)
    ranked = torch.where(values >= kth, values, 0.0)
    running = torch.cumsum(ranked, dim=-1)
    dropped = torch.zeros_like(keep).scatter_(1, order, (running - ranked >= cap) & (ranked > 0))
    outside = torch.ones_like(keep).scatter_(1, order, False)
    dropped |= outside & (running[:, -1:] >= cap)
    return keep & ~dropped


BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF in _draw


def _draw(logprobs: torch.Tensor, seqs: list[SeqState]) -> torch.Tensor:
    """Inverse-CDF sample of each row in vocabulary order, with one uniform draw keyed by
    each request's seed and token index (so a request's tokens do not depend on its batch
    neighbours).

    Vocabulary order (not probability order) keeps the draw stable under tiny float
    differences between batched and solo runs. Two levels: the running sum (float64) of
    the per-block masses (float32 sums of BLOCK probabilities) finds the block where the
    draw falls, and the running sum inside that one block finds the token. The same pick
    as one float64 running sum over the whole vocabulary but for draws within float32
    rounding of a block edge, at a third of its cost: the full cumsum, with its float64
    copy, took ~30 ms of a ~290 ms decode step at [128, 49152].
    The pick always has a nonzero probability. Runs on `logprobs`' device.
    """
    probs = logprobs.exp()
    rows, vocab = probs.shape
    cut = [i for i, s in enumerate(seqs) if 0 < s.params.top_k < vocab or s.params.top_p < 1.0]
    if cut:  # one batched pass over the rows that truncate
        device = probs.device
        index = torch.tensor(cut, device=device)
        part = probs.index_select(0, index)
        keep = truncation_mask(
            part, [seqs[i].params.top_k for i in cut], [seqs[i].params.top_p for i in cut]
        )
        probs.index_copy_(0, index, torch.where(keep, part, 0.0))
    blocks = torch.nn.functional.pad(probs, (0, (-vocab) % BLOCK)).view(rows, -1, BLOCK)
    block_cdf = torch.cumsum(blocks.sum(-1).double(), dim=-1)
    total = block_cdf[:, -1]
    u = uniforms(seqs, probs.device)
    # u < 1, but u * total may round up to total
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target[:, None], right=True)[:, 0]
    before = torch.where(
        block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0
    )
    inside = blocks[torch.arange(rows, device=probs.device), block]  # [rows, BLOCK]
    inner_cdf = torch.cumsum(inside.double(), dim=-1)
    offset = torch.searchsorted(inner_cdf, (target - before)[:, None], right=True)[:, 0]
    # rounding between the two levels may put the draw past the block's own sum: its
    # last token with a nonzero probability then
    last = BLOCK - 1 - torch.argmax(torch.flip(inside > 0, dims=[-1]).int(), dim=-1)
    return block * BLOCK + torch.minimum(offset, last)


# SplitMix64 (Steele, Lea and Flood, 2014): its stream increment and finaliser constants,
# written as signed int64 (the tensors' type; products wrap modulo 2**64 as unsigned ones).
GAMMA = 0x9E3779B97F4A7C15 - 2**64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >> bits as an unsigned 64-bit shift (torch's >> on int64 keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: a bijection of 64-bit words that scatters every input bit."""
    z = (z ^ _shift(z, 30)) * MIX1
    z = (z ^ _shift(z, 27)) * MIX2
    return z ^ _shift(z, 31)


def counter_uniforms(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float64 in [0, 1) for each (seed, index) pair (int64 tensors on one device): the
    index-th output of a SplitMix64 stream keyed by the mixed seed, top 53 bits. A pure
    function of the pair, so a request draws the same numbers alone or in any batch, on
    any device, after a pause or a retract, and no per-request generator steps on the
    host."""
    z = _mix(_mix(seeds) + (index + 1) * GAMMA)
    return _shift(z, 11).double() * 2.0**-53


def signed64(value: int) -> int:
    """A seed as the signed 64-bit word it keys (any Python int: its low 64 bits)."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def uniforms(seqs: list[SeqState], device: torch.device) -> torch.Tensor:
    """One float64 draw in [0, 1) for each request's next token (`counter_uniforms` of its
    seed and output index), computed on `device`. The keys go over in one host-to-device
    copy of a few bytes that does not wait for the device."""
    keys = torch.tensor(
        [[s.seed for s in seqs], [len(s.output_ids) for s in seqs]], dtype=torch.int64
    )
    if device.type != "cpu":
        keys = keys.pin_memory().to(device, non_blocking=True)
    return counter_uniforms(keys[0], keys[1])


def sample_tokens(logits: torch.Tensor, seqs: list[SeqState]) -> list[tuple[int, float]]:
    """Pick the next token and its logprob for each row of `logits` ([B, V], float32, on
    the model's device). Everything over the vocabulary runs there; only the B picks and
    their logprobs come back to the host, in one copy (one wait per step on a GPU).
    Full-vocabulary work is done once per step for each kind of row, and skipped where it
    cannot change the result. A greedy row (on the raw logits, as HF does) needs no
    log_softmax: its pick is the row's maximum m, and its logprob m - logsumexp(row) (one
    read of the row for each, against argmax + log_softmax's two reads and a write: at
    [128, 49152] ~5.5 against ~7.5 ms per step on 2 Xeon cores)."""
    rows, device = len(seqs), logits.device
    drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    tokens = torch.zeros(rows, dtype=torch.long, device=device)
    chosen = torch.zeros(rows, dtype=logits.dtype, device=device)
    if greedy:
        part = logits if not drawn else logits[greedy]
        top, picks = part.max(dim=-1)  # the first maximum, as argmax
        _put(tokens, greedy, picks, rows)
        _put(chosen, greedy, top - torch.logsumexp(part, dim=-1), rows)
    if drawn:
        part = logits if not greedy else logits[drawn]
        temps = [seqs[i].params.temperature for i in drawn]
        if any(t != 1.0 for t in temps):
            part = part / _column(part, temps)
        logprobs = torch.log_softmax(part, dim=-1)
        picks = _draw(logprobs, [seqs[i] for i in drawn])
        _put(tokens, drawn, picks, rows)
        _put(chosen, drawn, logprobs.gather(1, picks[:, None])[:, 0], rows)
    if device.type == "cpu":
        # One conversion per step: per-row .item() calls dominate small models.
        return list(zip(tokens.tolist(), chosen.tolist(), strict=True))
    # float64 holds every token id exactly; one device-to-host copy for both
    both = torch.stack([tokens.to(torch.float64), chosen.to(torch.float64)]).cpu()
    return [(int(t), float(lp)) for t, lp in zip(both[0].tolist(), both[1].tolist(), strict=True)]

"""Micro-batch planning, packing layout, and exactness of packed forwards on a tiny Llama."""

import random

import pytest
import torch

from areal_cli.trainer.losses import token_logprobs
from areal_cli.trainer.packing import (
    MicroBatchPlan,
    cu_seqlens_from_lengths,
    pack_sequences,
    packed_forward_kwargs,
    padding_fraction,
    plan_micro_batches,
    position_ids_from_cu_seqlens,
    seq_ids_from_cu_seqlens,
    unpack,
)


def assert_valid(plan: MicroBatchPlan, seqlens: list[int], cap: int) -> None:
    flat = sorted(i for mb in plan.mbs for i in mb)
    assert flat == list(range(len(seqlens)))  # every sequence exactly once
    for mb, tokens in zip(plan.mbs, plan.tokens_per_mb, strict=True):
        assert mb and mb == sorted(mb)
        assert tokens == sum(seqlens[i] for i in mb)
        assert tokens <= cap or len(mb) == 1  # only a lone over-long sequence may exceed


def test_plan_hand_example() -> None:
    # lengths [5, 3, 8, 2, 6], cap 10: total 24 -> ceil(2.4) = 3 bins.
    # longest first: 8 -> b0; 6 -> b1; 5 -> b2; 3 -> least-filled fitting = b2 (5 -> 8);
    # 2 -> loads [8, 6, 8] -> b1 (6 -> 8). Result [[2], [3, 4], [0, 1]], 8 tokens each.
    seqlens = [5, 3, 8, 2, 6]
    plan = plan_micro_batches(seqlens, max_tokens_per_mb=10)
    assert plan.mbs == [[2], [3, 4], [0, 1]]
    assert plan.tokens_per_mb == [8, 8, 8]
    # padded slots: 1*8 + 2*6 + 2*5 = 30 for 24 tokens -> 1 - 24/30 = 0.2
    assert plan.padding_fraction == pytest.approx(0.2)


def test_padding_fraction_hand_example() -> None:
    # [[4, 2], [3, 1]] padded to [2, 4] and [2, 3]: 14 slots, 10 tokens -> 4/14 = 2/7
    assert padding_fraction([4, 2, 3, 1], [[0, 1], [2, 3]]) == pytest.approx(2 / 7)
    assert padding_fraction([4, 4], [[0, 1]]) == 0.0
    assert padding_fraction([], []) == 0.0


def test_overlong_sequence_gets_own_micro_batch() -> None:
    # 12 > cap 10 -> alone; the rest (4 + 3 = 7) fits one bin
    plan = plan_micro_batches([12, 3, 4], max_tokens_per_mb=10)
    assert plan.mbs == [[0], [1, 2]]
    assert plan.tokens_per_mb == [12, 7]


def test_min_number_of_micro_batches() -> None:
    # six 1-token sequences, huge cap, n_mbs 4 -> 4 bins filled round-robin by load: 2, 2, 1, 1
    plan = plan_micro_batches([1] * 6, max_tokens_per_mb=100, n_mbs=4)
    assert plan.mbs == [[0, 4], [1, 5], [2], [3]]
    # cannot have more micro-batches than sequences
    assert len(plan_micro_batches([3, 3], max_tokens_per_mb=100, n_mbs=5).mbs) == 2
    # an over-long sequence counts towards n_mbs
    assert plan_micro_batches([50, 2, 2], max_tokens_per_mb=10, n_mbs=2).mbs == [[0], [1, 2]]


def test_random_plans_valid_deterministic_and_balanced() -> None:
    rng = random.Random(0)
    for _ in range(200):
        cap = rng.randint(8, 64)
        seqlens = [rng.randint(0, cap + 10) for _ in range(rng.randint(0, 40))]
        n_mbs = rng.randint(1, 6)
        plan = plan_micro_batches(seqlens, cap, n_mbs)
        assert_valid(plan, seqlens, cap)
        assert plan == plan_micro_batches(list(seqlens), cap, n_mbs)  # deterministic
        assert len(plan.mbs) >= min(n_mbs, len(seqlens))
    # balance on equal-size items: 12 x 5 tokens, cap 20 -> 3 full bins of 20
    assert plan_micro_batches([5] * 12, 20).tokens_per_mb == [20, 20, 20]


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], max_tokens_per_mb=0)
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], max_tokens_per_mb=4, n_mbs=0)
    with pytest.raises(ValueError):
        plan_micro_batches([1, -2], max_tokens_per_mb=4)


def test_pack_layout() -> None:
    # lengths [3, 1, 2] -> cu [0, 3, 4, 6], positions restart at 0, seq_ids per token
    seqs = [torch.tensor([7, 8, 9]), torch.tensor([4]), torch.tensor([5, 6])]
    pb = pack_sequences(seqs)
    assert pb.input_ids.tolist() == [7, 8, 9, 4, 5, 6]
    assert pb.cu_seqlens.tolist() == [0, 3, 4, 6] and pb.cu_seqlens.dtype == torch.int32
    assert pb.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert pb.seq_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert pb.max_seqlen == 3
    assert [t.tolist() for t in unpack(pb.input_ids, pb.cu_seqlens)] == [[7, 8, 9], [4], [5, 6]]
    cu = cu_seqlens_from_lengths([2, 0, 1])  # empty sequences are harmless
    assert position_ids_from_cu_seqlens(cu).tolist() == [0, 1, 0]
    assert seq_ids_from_cu_seqlens(cu).tolist() == [0, 0, 2]
    kw = packed_forward_kwargs(pb)
    assert kw["use_cache"] is False and kw["input_ids"].shape == (1, 6)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_matches_per_sequence(attn: str) -> None:
    """Packed micro-batches give the same per-token logprobs as each sequence run alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=128,
        initializer_range=0.1,  # less uniform outputs than 0.02, so a wrong mask shows clearly
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    lengths = [9, 1, 17, 4, 12, 6, 23, 2]
    seqs = [torch.randint(0, 100, (n,)) for n in lengths]
    plan = plan_micro_batches(lengths, max_tokens_per_mb=32, n_mbs=2)
    assert max(len(mb) for mb in plan.mbs) > 1  # something is actually packed
    with torch.no_grad():
        alone = [
            token_logprobs(model(input_ids=s[None], use_cache=False).logits[0], s, 0.8)
            for s in seqs
        ]
        worst, leak = 0.0, 0.0
        for mb in plan.mbs:
            pb = pack_sequences([seqs[i] for i in mb])
            logits = model(**packed_forward_kwargs(pb)).logits[0]
            lp = token_logprobs(logits, pb.input_ids, 0.8, cu_seqlens=pb.cu_seqlens)
            for i, got in zip(mb, unpack(lp, pb.cu_seqlens), strict=True):
                worst = max(worst, (got - alone[i]).abs().max().item())
            # control: with the default KV cache, transformers ignores the packing
            bad = model(input_ids=pb.input_ids[None], position_ids=pb.position_ids[None])
            ref = torch.cat([alone[i] for i in mb])
            bad_lp = token_logprobs(bad.logits[0], pb.input_ids, 0.8, cu_seqlens=pb.cu_seqlens)
            leak = max(leak, (bad_lp - ref).abs().max().item())
    assert worst < 1e-5
    assert leak > 1e-2

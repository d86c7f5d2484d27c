"""The embedded engine's attention: transformers' SDPA path, with one faster decode case.

At a decode step (one query token per row) of a grouped-query model (fewer key/value
heads than query heads), transformers folds the query heads of a group into the query
length and calls SDPA on the key/value heads (`pack_gqa`). On a CPU in bf16/fp16, SDPA's
own grouped-query mode (`enable_gqa=True`) does the same work faster with the running
batch's padding mask: measured with scripts/profile_inference.py on SmolLM2-135M (9 query
heads, 3 key/value heads), batch 128, bf16, ~175 cached tokens per row: 4.2 -> 3.0 ms per
layer, ~300 -> ~250 ms per step. transformers uses that mode only without a mask
(`use_gqa_in_sdpa`), and in fp32 it was slower here, so only that case changes. Every
other call (prefill, fp32, CUDA, models without grouped heads) goes to transformers'
`sdpa_attention_forward` unchanged, and masks are built as for "sdpa".
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "areal_sdpa"
HALF = (torch.bfloat16, torch.float16)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    decode_gqa = (
        query.shape[2] == 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.device.type == "cpu"
        and query.dtype in HALF
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not dropout
    )
    if not decode_gqa:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_for(model: Any) -> bool:
    """Switch a model that runs transformers' "sdpa" to this attention; True when it did."""
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME

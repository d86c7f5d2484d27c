"""The embedded engine's attention (areal_cli/inference/attention.py) against transformers' SDPA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from areal_cli.inference import attention
from areal_cli.inference.kv_cache import cache_kwarg


def _decode_logits(model_dir: Path, dtype: torch.dtype, ours: bool) -> torch.Tensor:
    """Logits of one batched decode step after a padded prefill, with a padding mask."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    if ours:
        assert attention.use_for(model)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lens = torch.tensor([len(p) for p in prompts])
    columns = torch.arange(width + 1)
    cache = DynamicCache(config=model.config)
    kwarg = cache_kwarg(model)  # `cache` in newer transformers, else past_key_values
    with torch.inference_mode():
        model(
            input_ids=ids,
            attention_mask=(columns[None, :width] < lens[:, None]).long(),
            position_ids=columns[None, :width].expand(2, -1),
            **{kwarg: cache},
            use_cache=True,
        )
        mask = (columns[None, :] < lens[:, None]) | (columns[None, :] == width)
        out = model(
            input_ids=torch.tensor([[21], [22]]),
            attention_mask=mask[:, None, None, :],
            position_ids=lens[:, None],
            **{kwarg: cache},
            use_cache=True,
        )
    return out.logits[:, -1].float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_matches_transformers(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    ours = _decode_logits(tiny_model_dir, dtype, ours=True)
    theirs = _decode_logits(tiny_model_dir, dtype, ours=False)
    if dtype == torch.float32:  # not our case: transformers' own path, unchanged
        assert torch.equal(ours, theirs)
    else:
        assert (ours - theirs).abs().max() < 0.05
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

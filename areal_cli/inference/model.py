"""The engine's model: our own decoder for Llama-family folders, transformers' otherwise.

`EngineModel` is what the scheduler runs: `forward(input_ids, position_ids, mask, cache,
last)` gives float logits [rows, vocab] at each row's `last` position (default: its final
one), and `prefill_cache()` / `running_batch(max_rows)` make the caches that forward fills.

- A Llama, Mistral, Qwen2 or Qwen3 folder (areal_cli.models.decoder.unsupported says
  which) runs on `DecoderLM`: built on the meta device, allocated on the engine's device
  and filled by the engine's WeightLoader from the folder's safetensors. The server then
  never imports transformers' modeling code (~2.3 s of CPU per start, issue 49), and the
  forward is ours: prefill is plain causal SDPA (rows are right-padded, so causality alone
  hides the padding), decode reads the slot cache under the running batch's mask, and
  grouped key/value heads are never repeated.
- Any other folder goes through `AutoModelForCausalLM`, its "sdpa" attention switched to
  areal_cli.inference.attention, and its DynamicCache built over the same slot layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from areal_cli.inference.kv_cache import RunningBatch, prefill_cache, row_index


def generation_eos(folder: Path, config: dict[str, Any]) -> Any:
    """eos_token_id as transformers' generation config gives it: generation_config.json's,
    else config.json's."""
    try:
        gen = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        gen = {}
    return gen.get("eos_token_id", config.get("eos_token_id"))


class EngineModel:
    """Either model behind one forward (see the module docstring)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        from areal_cli.models.decoder import DecoderConfig, unsupported

        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        self.own = unsupported(raw) is None
        self.sdpa = True  # the decode mask comes ready-made for SDPA
        if self.own:
            self.config: Any = DecoderConfig.from_dict(raw)
            self.module = self._build_own(self.config, dtype, device)
            self.eos_token_id = generation_eos(folder, raw)
        else:
            from transformers import AutoModelForCausalLM

            from areal_cli.inference import attention
            from areal_cli.inference.kv_cache import cache_kwarg

            self.module = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
            self.module.to(device).eval()
            self.sdpa = attention.use_for(self.module)  # else keeps its own (eager, ...)
            self.config = self.module.config
            self._cache_kwarg = cache_kwarg(self.module)
            generation = getattr(self.module, "generation_config", None)
            self.eos_token_id = getattr(generation, "eos_token_id", None)
        self.vocab_size = int(self.module.get_output_embeddings().weight.shape[0])

    @staticmethod
    def _build_own(cfg: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """A DecoderLM with its parameters allocated (not initialised: the weights are
        loaded next) and its rotary table computed, on `device`."""
        from areal_cli.models.decoder import DecoderLM, allocate

        model = DecoderLM.on_meta(cfg, dtype)
        allocate(model, device)
        if cfg.tie_word_embeddings:  # allocate gave each module its own tensor
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()

    def prefill_cache(self) -> Any:
        """An empty cache for one prefill pass."""
        return prefill_cache(self.config, hf=not self.own)

    def running_batch(self, max_rows: int) -> RunningBatch:
        return RunningBatch(self.config, max_rows, hf=not self.own)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Any,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float logits [rows, vocab] at each row's `last` position (default: the final
        one). `mask`: None for a right-padded prefill (the key padding mask [rows, columns]
        goes to a transformers model), else the decode mask from RunningBatch."""
        with torch.inference_mode():
            if self.own:
                out = self.module(
                    input_ids, position_ids, mask=mask if mask is None or mask.dim() == 4 else None,
                    cache=cache, last=last,
                )  # fmt: skip
                logits = out.logits if last is not None else out.logits[:, -1]
                return logits.float()
            keep: int | torch.Tensor = 1
            if last is not None:
                keep, last = torch.unique(last, return_inverse=True)
            out = self.module(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_kwarg: cache},
            )
            logits = out.logits[:, -1] if last is None else out.logits[row_index(last), last]
            return logits.float()

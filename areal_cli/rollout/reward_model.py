"""A trained reward model as a recipe's reward: `reward.fn: model:PATH`.

PATH is a scalar-head folder (an HF sequence-classification folder with one label), such
as the final checkpoint of an `algorithm: rm` run. Relative paths are taken from the
recipe's folder.

It scores token ids, not text: the prompt exactly as the rollout rendered it, then the
completion's tokens as the server generated them, then EOS when the completion does not
end with it (one cut by max_new_tokens is scored as if it ended there). That is the shape
the reward model was trained on (areal_cli.trainer.rm), so no text is re-tokenized. The
score is the head's output at the last token.

It runs in the reward worker pool (areal_cli.rollout.rewards) on CPU, one thread per
worker: the pool gathers the calls that arrive together into one padded forward, and
`reward.timeout_s` bounds each such batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_cli.config.model_info import REWARD_MODEL_PREFIX as PREFIX
from areal_cli.config.model_info import reward_model_path as model_path
from areal_cli.config.model_info import reward_model_problem

__all__ = ["PREFIX", "RewardModel", "model_path"]


class RewardModel:
    """A scalar-head model that scores token sequences; loads on first use."""

    batched = True  # the pool sends it lists of token-id sequences (see `score_ids`)

    def __init__(self, path: Path) -> None:
        problem = reward_model_problem(path)
        if problem:
            raise ValueError(problem)
        self.path = path
        self._model: Any = None
        self._eos: int | None = None
        self._pad = 0
        self._own = False  # our DecoderScorer (see `load`)

    def load(self) -> None:
        """The Llama family loads into our own decoder's scalar model (DecoderScorer: no
        transformers modeling import in the worker); any other architecture into
        transformers' AutoModelForSequenceClassification."""
        import torch

        from areal_cli.models.decoder import DecoderConfig, DecoderScorer, allocate, unsupported

        torch.set_num_threads(1)
        config = json.loads((self.path / "config.json").read_text())
        if unsupported(config) is None:
            from safetensors.torch import load_file

            model = DecoderScorer.on_meta(DecoderConfig.from_dict(config), torch.float32)
            allocate(model, "cpu")
            state: dict[str, torch.Tensor] = {}
            for f in sorted(self.path.glob("*.safetensors")):
                state.update(load_file(str(f)))
            model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
            self._own = True
        else:
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_pretrained(
                self.path, dtype=torch.float32
            )
        self._model = model.eval()
        eos, pad = config.get("eos_token_id"), config.get("pad_token_id")
        self._eos = eos[0] if isinstance(eos, list) else eos
        self._pad = pad if pad is not None else 0

    def __call__(self, completion: str, answer: str, **fields: Any) -> float:
        raise TypeError("a model reward scores token ids; the reward pool calls score_ids")

    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        """The score of each sequence (ids of prompt and completion), one padded forward."""
        import torch

        if self._model is None:
            self.load()
        seqs = [list(s) for s in sequences]
        for s in seqs:
            if not s:
                raise ValueError("cannot score an empty sequence")
            if self._eos is not None and s[-1] != self._eos:
                s.append(self._eos)
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), self._pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.inference_mode():
            if self._own:  # right padding under causal attention: no real token sees a pad
                scores = self._model(ids).float()
            else:
                out = self._model.base_model(input_ids=ids, attention_mask=mask)
                scores = self._model.score(out.last_hidden_state).squeeze(-1).float()
        last = mask.sum(dim=1) - 1
        return scores[torch.arange(len(seqs)), last].tolist()

"""Scalar-head models: a causal LM's body with one linear output per token.

A reward model (and, later, a PPO critic) is the body of a language model (embeddings,
blocks, final norm) and a head `score`: Linear(hidden, 1, no bias) applied at every
position. It is stored as a Hugging Face sequence-classification folder
(`<Arch>ForSequenceClassification`, `num_labels: 1`): tensors `model.*` (the body, named
as in the causal LM) and `score.weight` [1, hidden]. `AutoModelForSequenceClassification`
loads it as it is; its forward returns the head at each row's last token that is not the
pad token, which is where this product reads a conversation's score (its final token,
the EOS) when the tokenizer's pad token is not its EOS.

`make_scalar_folder` turns a causal LM folder into such a folder: the body's tensors are
copied, `lm_head` is dropped and the head is drawn from N(0, initializer_range) with a
seed, so every rank and every rerun starts from the same head (a PPO critic's starts at
zero instead: its first values say nothing, rather than noise as large as the rewards).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from areal_cli.config.model_info import is_scalar_config

HEAD = "score.weight"


def architecture(config: dict) -> str:
    return (config.get("architectures") or [""])[0]


def scalar_config(config: dict) -> dict:
    """The causal LM's config as a one-label sequence-classification config."""
    name = architecture(config)
    if not name.endswith("ForCausalLM"):
        raise ValueError(f"cannot put a scalar head on a {name or 'model with no architectures'}")
    out = dict(config)
    out["architectures"] = [name.removesuffix("ForCausalLM") + "ForSequenceClassification"]
    out["num_labels"] = 1
    out["id2label"] = {"0": "LABEL_0"}
    out["label2id"] = {"LABEL_0": 0}
    out["problem_type"] = "regression"
    out["tie_word_embeddings"] = False  # there is no LM head to tie
    return out


def make_scalar_folder(src: Path, dst: Path, seed: int, head_std: float | None = None) -> Path:
    """Write DST, a scalar-head folder with the body of the causal LM in SRC (atomic: a
    temp folder renamed into place). DST is returned as it is when it already exists.
    The head is drawn from N(0, head_std), by default the model's initializer_range; 0
    gives a head that outputs 0 everywhere (a critic with no opinion yet)."""
    import torch
    from safetensors.torch import load_file, save_file

    from areal_cli.rundir.layout import model_files_to_copy

    if (dst / "config.json").is_file():
        return dst
    config = json.loads((src / "config.json").read_text())
    if is_scalar_config(config):
        raise ValueError(f"{src} already has a scalar head; train it directly")
    new_config = scalar_config(config)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    body = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    if not body:
        raise FileNotFoundError(f"{src} holds no .safetensors weights")
    hidden = int(config["hidden_size"])
    generator = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02)) if head_std is None else head_std
    dtype = next(iter(body.values())).dtype
    head = torch.randn((1, hidden), generator=generator) * std
    body[HEAD] = head.to(dtype)
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in body.items()}, str(tmp / "model.safetensors"))
    for f in model_files_to_copy(src):
        if f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
    tmp.rename(dst)
    return dst

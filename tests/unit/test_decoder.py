"""Our own Llama-family decoder (areal_cli/models/decoder.py) against transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_cli.models.decoder import DecoderConfig, DecoderLM, DecoderScorer, unsupported
from tests.conftest import heavy_imports_after

SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_config(name: str):
    import transformers as t

    return {
        "llama-biases": lambda: t.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True),
        "llama3-rope": lambda: t.LlamaConfig(**SHAPE, rope_scaling=LLAMA3, rope_theta=5e5),
        "llama-linear-rope": lambda: t.LlamaConfig(
            **SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0}
        ),
        "qwen2-tied": lambda: t.Qwen2Config(**SHAPE, tie_word_embeddings=True),
        "qwen3-head-dim": lambda: t.Qwen3Config(**SHAPE, head_dim=24),
        "mistral": lambda: t.MistralConfig(**SHAPE, sliding_window=None),
    }[name]()


@pytest.mark.parametrize(
    "name",
    ["llama-biases", "llama3-rope", "llama-linear-rope", "qwen2-tied", "qwen3-head-dim", "mistral"],
)
def test_logits_equal_transformers(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(name)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)  # biases and norms too, so that each one matters
    hf.save_pretrained(tmp_path)
    cfg = DecoderConfig.from_folder(tmp_path)
    ours = DecoderLM(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=not cfg.tie_word_embeddings)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    positions = torch.stack([torch.arange(40), torch.arange(100, 140)])  # rotary far out too
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=positions).logits
        got = ours(input_ids=ids, position_ids=positions).logits
        last = ours(ids, positions, last=torch.tensor([5, 39])).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.allclose(last, got[[0, 1], [5, 39]], atol=1e-6)


@pytest.mark.parametrize("name", ["llama-biases", "qwen2-tied", "qwen3-head-dim"])
def test_scores_equal_transformers_sequence_classification(name: str, tmp_path: Path) -> None:
    """A scalar-head folder (a reward model's or critic's) built on our body gives the
    head's output at every position as transformers' *ForSequenceClassification body
    and `score` do, with the same tensor names and no lm_head (tied or not)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from areal_cli.models.scalar_head import make_scalar_folder

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(hf_config(name))
    with torch.no_grad():
        for p in lm.parameters():
            p.normal_(0, 0.2)
    lm.save_pretrained(tmp_path / "lm")
    folder = make_scalar_folder(tmp_path / "lm", tmp_path / "rm", seed=3, head_std=0.5)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ours = DecoderScorer(DecoderConfig.from_folder(folder)).eval()
    state = load_file(str(next(folder.glob("*.safetensors"))))
    assert set(ours.state_dict()) == set(state) and "lm_head.weight" not in state
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    positions = torch.stack([torch.arange(40), torch.arange(100, 140)])
    with torch.no_grad():
        hidden = hf.base_model(input_ids=ids, position_ids=positions).last_hidden_state
        want = hf.score(hidden).squeeze(-1)
        got = ours(input_ids=ids, position_ids=positions, use_cache=False)
    assert got.shape == (2, 40) and want.abs().max() > 0.1
    assert (got - want).abs().max().item() <= 1e-5


def test_names_and_shapes_are_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config("qwen3-head-dim"))
    hf.save_pretrained(tmp_path)
    ours = DecoderLM(DecoderConfig.from_folder(tmp_path))
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items()} == {
        n: tuple(t.shape) for n, t in hf.state_dict().items()
    }


@pytest.mark.parametrize(
    "change, why",
    [
        ({"model_type": "gemma"}, "model_type 'gemma'"),
        ({"model_type": "mistral", "sliding_window": 64}, "sliding-window"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64},
            "sliding-window",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rotary scaling 'yarn'"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
    ],
)
def test_other_models_are_named_for_transformers(change: dict, why: str) -> None:
    config = {"model_type": "llama", **SHAPE, **change}
    assert why in (unsupported(config) or "")


def test_a_llama_folder_served_without_transformers_modeling(tiny_model_dir: Path) -> None:
    """The embedded engine runs our decoder: its process never imports transformers'
    modeling code (the ~2.3 s of a server's start that issue 49 measured)."""
    printed, heavy = heavy_imports_after(
        "from areal_cli.inference.engine import InferenceEngine\n"
        f"e = InferenceEngine({str(tiny_model_dir)!r}, device='cpu')\n"
        "print(type(e.model).__name__)\n"
        "e.shutdown()\n"
    )
    assert printed == ["DecoderLM"] and heavy == []

"""The offline tiny-model builder: loadable, deterministic, sized as promised, chat-ready."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from areal_cli.models.tiny_model import (
    EOS_TOKEN,
    MARKER_FILE,
    build_tiny_model,
    build_tokenizer,
    count_parameters,
)

REPO = Path(__file__).resolve().parents[2]
SAMPLES = [
    "12+7=19",
    "What is 3*4? The answer is 12.",
    "The cat and the dog run to the river!",
    "<|user|>\nWhat is 2+2?<|eos|>\n<|assistant|>\n4<|eos|>\n",
    "unseen wörds 😀 and\ttabs",
]


def test_folder_layout_and_config(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER_FILE} <= names
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama"
    assert config.tie_word_embeddings is False
    assert config.head_dim >= 32
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    # No stray temp folders left next to the result.
    assert not [p for p in tiny_model_dir.parent.iterdir() if ".tmp-" in p.name]


def test_loads_with_auto_classes_and_size(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert 500_000 <= count_parameters(model) <= 3_000_000
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 3, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_saved_tokenizer_matches_trained_one(tiny_model_dir: Path) -> None:
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained = build_tokenizer()
    assert len(loaded) == len(trained)
    for text in SAMPLES:
        ids = trained(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == text
    assert loaded.eos_token == EOS_TOKEN
    assert {loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id} <= set(range(8))


def test_chat_template(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|system|>\nBe brief.<|eos|>\n<|user|>\nWhat is 2+2?<|eos|>\n<|assistant|>\n"
    no_gen = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_gen.endswith("<|assistant|>\n")
    ids = tokenizer(prompt)["input_ids"]
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert tokenizer.convert_tokens_to_ids(role) in ids


def test_deterministic_for_a_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", "tiny", seed=0)
    other = build_tiny_model(tmp_path / "other", "tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_reuses_same_build_and_refuses_foreign_folder(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", "tiny", seed=3)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(out, "tiny", seed=3) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError):
        build_tiny_model(out, "tiny", seed=4)
    with pytest.raises(ValueError, match="unknown preset"):
        build_tiny_model(tmp_path / "x", "huge")


@pytest.mark.slow
def test_small_preset_size(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "small", "small", seed=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert 20_000_000 <= count_parameters(model) <= 30_000_000
    assert model.config.head_dim >= 32


@pytest.mark.slow
def test_script(tmp_path: Path) -> None:
    out = tmp_path / "script-model"
    cmd = [sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(out), "--seed", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    assert (out / "model.safetensors").is_file()
    bad = subprocess.run([*cmd[:2], str(out), "--preset", "huge"], capture_output=True, text=True)
    assert bad.returncode != 0


def test_demo_prompts_render_as_the_rollout_renders_dataset_rows(tiny_model_dir: Path) -> None:
    """The tiny-arith warm-up trains on the very token ids the rollout will send."""
    from areal_cli.config.schema import DatasetConfig
    from areal_cli.data.prompts import format_prompt
    from areal_cli.models.demo_model import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for a, b in ((0, 0), (3, 4), (9, 9)):
        row = {"prompt": f"What is {a}+{b}?", "answer": str(a + b)}
        assert prompt_ids(tokenizer, a, b) == format_prompt(tokenizer, row, DatasetConfig())


def test_validation_knows_the_builtin_architectures(tiny_model_dir: Path) -> None:
    """config.BUILTIN_ARCHITECTURES (read before any model is built) matches real builds:
    the tiny model's config.json field for field, and the small preset's sizes."""
    import json

    from areal_cli.config.schema import BUILTIN_ARCHITECTURES
    from areal_cli.models.tiny_model import PRESETS

    built = json.loads((tiny_model_dir / "config.json").read_text())
    for name in ("tiny", "tiny-arith"):
        assert {k: built[k] for k in BUILTIN_ARCHITECTURES[name]} == BUILTIN_ARCHITECTURES[name]
    small, preset = BUILTIN_ARCHITECTURES["small"], PRESETS["small"]
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers"):
        assert small[field] == getattr(preset, field)
    assert (small["num_attention_heads"], small["num_key_value_heads"]) == (
        preset.num_attention_heads,
        preset.num_key_value_heads,
    )

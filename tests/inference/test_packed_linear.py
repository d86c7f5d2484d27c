"""The engine's prepared linear layers (areal_cli/inference/packed.py), packed for oneDNN
or widened to fp32: torch's numbers, prepared again at every weight version, dropped with
released weights. The widened kind runs on every CPU (AREAL_ENGINE_PACKED_LINEAR=widen),
the packed kind where oneDNN has native bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_cli.inference import packed
from areal_cli.inference.api import GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine
from areal_cli.models.decoder import DecoderConfig, DecoderLM

NATIVE, WHY = packed.choose(torch.device("cpu"), torch.bfloat16)
KINDS = [
    pytest.param("packed", marks=pytest.mark.skipif(NATIVE != "packed", reason=WHY)),
    "widened",
]


def _use(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepare linear layers as `kind` (auto is "packed" wherever that test runs)."""
    monkeypatch.setenv(packed.ENV, "widen" if kind == "widened" else "auto")


def _greedy(engine: InferenceEngine, ids: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    out = engine.generate_sync(
        GenerateRequest(input_ids=ids, sampling_params=params, return_logprob=True), 60
    )
    return out.output_ids, out.output_logprobs


def _same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    """The same tokens, and logprobs within bf16's tolerance against transformers."""
    return a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) <= 1e-3


def _model(bias: bool, hidden: int = 256) -> DecoderLM:
    """Every weight of it is prepared at hidden 256; at 64, the MLP's and the head."""
    cfg = DecoderConfig.from_dict({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": hidden,
        "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "attention_bias": bias,
        "tie_word_embeddings": True,
    })  # fmt: skip
    torch.manual_seed(0)
    return DecoderLM(cfg).to(torch.bfloat16).eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_prepared_layers_give_torchs_numbers(
    bias: bool, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use(kind, monkeypatch)
    model = _model(bias)
    ids = torch.randint(0, 300, (3, 9))
    with torch.inference_mode():
        plain = model(ids).logits.float()
        layers = packed.PackedLinears(model)
        layers.refresh()
        assert layers.active and layers.kind == kind, layers.describe()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert layers.layers == linears
        copy = "packed_weight" if kind == "packed" else "wide_weight"
        assert all(copy in m.__dict__ for m in layers.layers)
        weights = sum(m.weight.nbytes for m in layers.layers)
        biases = sum(m.bias.nbytes for m in layers.layers if m.bias is not None)
        assert layers.nbytes == (weights if kind == "packed" else 2 * (weights + biases))
        fast = model(ids).logits.float()
        # The forward reads the prepared copies, not torch's weights: with those zeroed
        # (but the head's, which is the embedding's too) it gives the same numbers.
        # Rounding proves nothing here: with a bias, both kinds gave torch's very bits on
        # a Xeon with AMX-FP16 (2026-12-07), other bits on other CPUs.
        embedding = model.get_input_embeddings().weight
        zeroed = [m.weight for m in layers.layers if m.weight is not embedding]
        kept = [w.clone() for w in zeroed]
        for w in zeroed:
            w.zero_()
        blind = model(ids).logits.float()
        for w, k in zip(zeroed, kept, strict=True):
            w.copy_(k)
        layers.drop()
        assert not any(copy in m.__dict__ for m in layers.layers)
        again = model(ids).logits.float()
    assert torch.equal(blind, fast)
    assert torch.equal(again, plain)  # torch's forward is back
    if bias or kind == "widened":  # a fused bias, or sums in another order: bf16 rounding
        assert (fast - plain).abs().max() <= 0.02 * plain.abs().max()
    else:
        assert torch.equal(fast, plain)


def test_tiny_layers_stay_on_torchs_kernels() -> None:
    """Under MIN_WEIGHT elements torch's own path is the faster one at one row: at hidden
    64 the attention projections (64x64, 64x32) stay unpacked, the MLP (64x384) and the
    head do not."""
    model = _model(False, hidden=64)
    chosen = packed.PackedLinears(model).layers
    names = {n.split(".")[-1] for n, m in model.named_modules() if m in chosen}
    assert names == {"gate_proj", "up_proj", "down_proj", "lm_head"}, names
    attention = packed.PackedLinears(model.model.layers[0].self_attn)
    attention.refresh()
    assert not attention.active and f"under {packed.MIN_WEIGHT} elements" in attention.describe()


def test_fp32_and_off_run_torchs_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(False).float()
    layers = packed.PackedLinears(model)
    layers.refresh()
    assert not layers.active and "float32" in layers.describe()
    monkeypatch.setenv(packed.ENV, "off")
    assert packed.choose(torch.device("cpu"), torch.bfloat16) == (None, f"{packed.ENV}=off")
    monkeypatch.setenv(packed.ENV, "widen")
    assert packed.choose(torch.device("cpu"), torch.float32)[0] is None
    monkeypatch.setenv(packed.ENV, "fast")
    with pytest.raises(ValueError, match="must be one of auto, widen, off"):
        packed.choose(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_serves_each_version_on_its_own_prepared_weights(
    kind: str,
    tiny_model_dir: Path,
    tiny_model_dir_alt: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copies made from stale weights would keep serving the old version: every update,
    and a release and the load after it, must prepare them again."""
    prompt = [40, 41, 42, 43, 44]
    monkeypatch.setenv(packed.ENV, "off")
    with InferenceEngine(tiny_model_dir_alt, device="cpu", dtype="bfloat16") as plain:
        want_alt = _greedy(plain, prompt)
    _use(kind, monkeypatch)
    with InferenceEngine(tiny_model_dir, device="cpu", dtype="bfloat16") as eng:
        layers = eng._loader.packed
        assert layers.active and layers.kind == kind
        first = _greedy(eng, prompt)
        update = eng.update_weights_from_disk(tiny_model_dir_alt, "v1")
        assert update.ok, update.message
        assert layers.active
        assert _same(_greedy(eng, prompt), want_alt)
        eng.pause("abort")
        eng.release_memory_occupation(["weights"])
        assert not layers.active and layers.nbytes == 0
        eng.resume_memory_occupation(["weights"])
        eng.continue_generation()
        update = eng.update_weights_from_disk(tiny_model_dir, "v2")
        assert update.ok, update.message
        assert layers.active
        assert _same(_greedy(eng, prompt), first)
    assert first[0] != want_alt[0]  # the versions differ, so the checks above can fail

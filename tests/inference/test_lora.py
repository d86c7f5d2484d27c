"""LoRA adapters (areal_cli/models/lora.py): the layer against its merge, PEFT's own
loader against our folders, and the embedded engine serving an adapter exactly as the
merged model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from areal_cli.inference.api import GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine
from areal_cli.models import lora
from areal_cli.models.decoder import DecoderConfig, DecoderLM
from areal_cli.rundir import handoff
from areal_cli.rundir.safetensors_io import write_safetensors

SPEC = lora.LoraSpec(rank=4, alpha=8.0, target_modules=("all-linear",))
PROBE = torch.tensor([[5, 300, 12, 99, 40, 41, 42, 7]])


def _decoder(folder: Path) -> DecoderLM:
    from safetensors.torch import load_file

    model = DecoderLM(DecoderConfig.from_folder(folder), "cpu")
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    return model.eval()


def _trained_adapter(folder: Path, seed: int = 3) -> tuple[DecoderLM, dict[str, torch.Tensor]]:
    """The base model with adapters on every linear layer, B made non-zero (as training
    would), and the adapters by our keys."""
    model = _decoder(folder)
    lora.inject(model, SPEC)
    state = lora.initial_state(model, seed)
    g = torch.Generator().manual_seed(seed)
    for key in state:
        if key.endswith("lora_B"):
            state[key] = torch.randn(state[key].shape, generator=g) * 0.02
    model.load_state_dict(state, strict=False)
    return model, state


def _adapter_folder(tmp: Path, base: Path, state: dict[str, torch.Tensor]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    lora.write_adapter(tmp, state, SPEC, str(base))
    return tmp


def _merged_folder(out: Path, base: Path, adapter_dir: Path) -> Path:
    from safetensors.torch import load_file

    shutil.copytree(base, out)
    merged = lora.merge_into(
        load_file(str(base / "model.safetensors")), lora.read_adapter(adapter_dir)
    )
    (out / "model.safetensors").unlink()
    write_safetensors(out, "model.safetensors", merged)
    return out


def test_targets_follow_peft_matching(tiny_model_dir: Path) -> None:
    names = lora.linear_modules(_decoder(tiny_model_dir))
    assert not any(n.endswith("lm_head") for n in names)
    assert len(lora.select(names, ["all-linear"])) == len(names)
    assert {n.rsplit(".", 1)[-1] for n in lora.select(names, ["q_proj", "v_proj"])} == {
        "q_proj",
        "v_proj",
    }
    assert lora.select(names, r".*\.0\.self_attn\.q_proj") == ["model.layers.0.self_attn.q_proj"]
    assert lora.unmatched(names, ["q_proj", "qkv_proj"]) == ["qkv_proj"]
    with pytest.raises(lora.AdapterError, match="qkv_proj"):
        lora.inject(_decoder(tiny_model_dir), lora.LoraSpec(4, 8.0, ("qkv_proj",)))


def test_peft_keys_round_trip() -> None:
    key = "model.layers.0.self_attn.q_proj.lora_A"
    assert lora.peft_key(key) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.our_key(lora.peft_key(key)) == key
    with pytest.raises(lora.AdapterError):
        lora.our_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")


def test_fresh_adapter_changes_nothing_and_merge_equals_on_the_fly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """B starts at zero (the policy starts as the base); a trained adapter applied on the
    fly and merged into the weights give the same logits within 1e-5 in float32."""
    base = _decoder(tiny_model_dir)
    fresh = _decoder(tiny_model_dir)
    lora.inject(fresh, SPEC)
    fresh.load_state_dict(lora.initial_state(fresh, 0), strict=False)
    with torch.no_grad():
        assert torch.equal(base(PROBE).logits, fresh(PROBE).logits)
    model, state = _trained_adapter(tiny_model_dir)
    adapter_dir = _adapter_folder(tmp_path / "adapter", tiny_model_dir, state)
    merged = _decoder(_merged_folder(tmp_path / "merged", tiny_model_dir, adapter_dir))
    with torch.no_grad():
        on_the_fly, folded = model(PROBE).logits, merged(PROBE).logits
        assert float((on_the_fly - base(PROBE).logits).abs().max()) > 1e-3  # it does adapt
    # one folded matmul against two, in fp32: 1.2e-5 on logits of ~3 on a Xeon with AMX
    assert float((on_the_fly - folded).abs().max()) < 5e-5


def test_peft_loads_our_adapter_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    """PEFT itself reads the folder we write and computes the same logits."""
    peft = pytest.importorskip("peft", reason="peft is a dev extra (make install installs it)")
    from transformers import AutoModelForCausalLM

    model, state = _trained_adapter(tiny_model_dir)
    adapter_dir = _adapter_folder(tmp_path / "adapter", tiny_model_dir, state)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        theirs, ours = wrapped(input_ids=PROBE).logits, model(PROBE).logits
    assert float((theirs - ours).abs().max()) < 1e-5


def _greedy(engine: InferenceEngine, ids: list[int]) -> tuple[list[int], list[float], str]:
    out = engine.generate_sync(
        GenerateRequest(
            input_ids=ids,
            sampling_params=SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
            return_logprob=True,
        )
    )
    return out.output_ids, out.output_logprobs, out.weight_version


def test_engine_serves_an_adapter_as_the_merged_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Loading adapter vK (merged on load) gives the merged vK's tokens and logprobs; a
    corrupt adapter (truncated; a flipped bit that its entry's CRC-32 catches; a variant
    we do not apply) is refused with its reason and the served version stays; an engine
    started from an adapter folder serves it on its base."""
    _, state = _trained_adapter(tiny_model_dir)
    adapter_dir = _adapter_folder(tmp_path / "v1", tiny_model_dir, state)
    merged_dir = _merged_folder(tmp_path / "merged", tiny_model_dir, adapter_dir)
    prompt = [5, 300, 12, 99]
    with InferenceEngine(merged_dir, device="cpu") as reference:
        want_ids, want_lp, _ = _greedy(reference, prompt)
    with InferenceEngine(tiny_model_dir, device="cpu", weight_version="0") as engine:
        _, base_lps, _ = _greedy(engine, prompt)
        ok, message, _ = engine.update_weights_from_disk(adapter_dir, "1")
        assert ok, message
        ids, lps, version = _greedy(engine, prompt)
        assert (ids, version) == (want_ids, "1")
        assert max(abs(a - b) for a, b in zip(lps, want_lp, strict=True)) <= 1e-4
        assert max(abs(a - b) for a, b in zip(lps, base_lps, strict=True)) > 1e-3  # adapted
        broken = tmp_path / "v2"
        shutil.copytree(adapter_dir, broken)
        weights = broken / lora.ADAPTER_WEIGHTS
        weights.write_bytes(weights.read_bytes()[:-100])  # truncated
        ok, message, _ = engine.update_weights_from_disk(broken, "2")
        assert not ok and "adapter_model.safetensors" in message and "still serving '1'" in message
        assert _greedy(engine, prompt)[:2] == (want_ids, lps)
        entry = handoff.write_entry(
            tmp_path, "v3", 3, lambda d: lora.write_adapter(d, state, SPEC, str(tiny_model_dir))
        )
        data = bytearray((entry.path / lora.ADAPTER_WEIGHTS).read_bytes())
        data[-5] ^= 0x40  # a flipped bit in a weight: same size, still parses
        (entry.path / lora.ADAPTER_WEIGHTS).write_bytes(bytes(data))
        ok, message, _ = engine.update_weights_from_disk(entry.path, "3")
        assert not ok and "fails its CRC-32 check" in message, message
        assert _greedy(engine, prompt)[:2] == (want_ids, lps)
        config = broken / lora.ADAPTER_CONFIG
        config.write_text(
            json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
        )
        ok, message, _ = engine.update_weights_from_disk(broken, "2")
        assert not ok and "use_dora" in message
    with InferenceEngine(adapter_dir, device="cpu") as started:
        assert _greedy(started, prompt)[0] == want_ids


def test_adapters_received_over_the_group_serve_as_the_folder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The distributed method sends a LoRA model's adapters only, B times its scale
    (trainer.weight_sender.sent_items); the engine merges what it receives into its base
    and serves exactly what the adapter folder gives."""
    from areal_cli.trainer.weight_sender import sent_items

    model, state = _trained_adapter(tiny_model_dir)
    items = sent_items(model)
    assert {name for name, _, _ in items} == set(state)
    assert {factor for name, _, factor in items if name.endswith("lora_B")} == {SPEC.scale}
    received = {name: tensor.detach() * factor for name, tensor, factor in items}
    adapter_dir = _adapter_folder(tmp_path / "v1", tiny_model_dir, state)
    prompt = [5, 300, 12, 99]
    with InferenceEngine(tiny_model_dir, device="cpu", weight_version="0") as engine:
        assert engine.update_weights_from_disk(adapter_dir, "1").ok
        want = _greedy(engine, prompt)
        update = engine.submit_received_weights(received, "2").result(60)
        assert update.ok, update.message
        ids, lps, version = _greedy(engine, prompt)
    assert (ids, version) == (want[0], "2")
    assert max(abs(a - b) for a, b in zip(lps, want[1], strict=True)) <= 1e-6


@pytest.mark.slow
def test_the_embedded_server_takes_sglangs_lora_routes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """/load_lora_adapter and /unload_lora_adapter with SGLang's bodies and answers: a
    request's lora_path must name the loaded adapter (never ignored), loading keeps the
    version label, unloading serves the base again, and a folder outside --weight-root
    is refused (403)."""
    from tests.inference.test_server import serve

    _, state = _trained_adapter(tiny_model_dir)
    root = tmp_path / "root"
    adapter = _adapter_folder(root / "v1", tiny_model_dir, state)
    outside = _adapter_folder(tmp_path / "outside", tiny_model_dir, state)
    ask = {"input_ids": [5, 300, 12], "return_logprob": True}
    ask["sampling_params"] = {"temperature": 0, "max_new_tokens": 4}
    server = serve(tiny_model_dir, "--weight-root", str(root), "--weight-version", "7")
    srv = next(server)
    try:
        status, base = srv.call("/generate", ask, key=None)
        assert status == 200
        assert srv.call("/generate", {**ask, "lora_path": "a"}, key=None)[0] == 400
        status, body = srv.call(
            "/load_lora_adapter", {"lora_name": "a", "lora_path": str(outside)}, key=None
        )
        assert status == 403 and body["success"] is False
        status, body = srv.call(
            "/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)}, key=None
        )
        assert status == 200 and body == {"success": True, "loaded_adapters": {"a": str(adapter)}}
        status, adapted = srv.call("/generate", {**ask, "lora_path": "a"}, key=None)
        assert status == 200 and adapted["meta_info"]["weight_version"] == "7"
        lps = [x[0] for x in adapted["meta_info"]["output_token_logprobs"]]
        assert lps != [x[0] for x in base["meta_info"]["output_token_logprobs"]]
        assert srv.call("/unload_lora_adapter", {"lora_name": "b"}, key=None)[0] == 400
        assert srv.call("/unload_lora_adapter", {"lora_name": "a"}, key=None)[1]["success"]
        status, again = srv.call("/generate", ask, key=None)
        assert (
            again["meta_info"]["output_token_logprobs"]
            == base["meta_info"]["output_token_logprobs"]
        )
    finally:
        server.close()

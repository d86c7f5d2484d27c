"""`areal convert-checkpoint` on a real 2-rank DCP checkpoint: round trips, serving, bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import areal_in_process, free_port, run_areal
from tests.gloo.conftest import make_batches, torchrun, write_config

pytestmark = [pytest.mark.gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def recover_entry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A DCP recover checkpoint written by 2 gloo ranks, and the model folder it came from."""
    from tests.gloo.conftest import make_model

    tmp = tmp_path_factory.mktemp("convert")
    model = make_model(tmp / "model")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordLevel({f"w{i}": i for i in range(96)} | {"[UNK]": 95}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="w1"
    ).save_pretrained(model)
    make_batches(tmp / "batches", 1)
    cfg = write_config(
        tmp / "cfg.yaml", model, tmp / "runs", total_train_steps=1, **{"recover.freq_steps": 1}
    )
    torchrun(2, cfg, "--batches", str(tmp / "batches"))
    return tmp / "runs" / "gloo" / "t" / "recover" / "step-1", model


def test_round_trip_is_bit_exact_and_serves(
    recover_entry: tuple[Path, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    entry, model = recover_entry
    hf1, dcp, hf2 = tmp_path / "hf1", tmp_path / "dcp", tmp_path / "hf2"
    first = run_areal(
        "convert-checkpoint", str(entry), str(hf1), "--model-config", str(model), "--verify"
    )
    assert first.returncode == 0, first.stderr
    assert "max |logit difference| = 0" in first.stdout
    to_dcp = run_areal("convert-checkpoint", str(hf1), str(dcp), "--verify")
    assert to_dcp.returncode == 0
    assert f"converted HF folder {hf1} -> DCP checkpoint {dcp} in " in to_dcp.stdout
    assert (dcp / "dcp" / ".metadata").exists()
    # an output named like the format SRC already is: refused without --to, taken with it
    named = areal_in_process("convert-checkpoint", str(hf1), str(tmp_path / "hf_out"))
    assert named.returncode == 2 and not (tmp_path / "hf_out").exists()
    assert "hf_out reads like an HF folder, but" in named.stderr
    assert "so it would become DCP; pass --to dcp" in named.stderr
    told = areal_in_process("convert-checkpoint", str(hf1), str(tmp_path / "hf_out"), "--to", "dcp")
    assert told.returncode == 0 and (tmp_path / "hf_out" / "dcp" / ".metadata").exists()
    assert (
        run_areal("convert-checkpoint", str(dcp), str(hf2), "--model-config", str(model)).returncode
        == 0
    )
    assert (hf1 / "model.safetensors").read_bytes() == (hf2 / "model.safetensors").read_bytes()
    weights = load_file(str(hf1 / "model.safetensors"))
    assert weights.keys() == load_file(str(model / "model.safetensors")).keys()
    hf = AutoModelForCausalLM.from_pretrained(hf1, dtype=torch.float32)
    assert hf.config.vocab_size == 96
    _serves(hf1, tmp_path / "serve.log")


def test_bf16_verify_passes_and_a_failed_verify_replaces_nothing(
    recover_entry: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file, save_file

    from areal_cli.weights import convert as conversion

    entry, model = recover_entry
    out = tmp_path / "bf16"
    args = ("convert-checkpoint", str(entry), str(out), "--model-config", str(model))
    first = run_areal(*args, "--dtype", "bf16", "--verify")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "= 0 against SRC cast to bfloat16 (tolerance 0.0001)" in first.stdout
    assert "against SRC as stored (the cost of rounding to bfloat16)" in first.stdout
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    before = (out / "model.safetensors").read_bytes()

    real = conversion.dcp_to_hf

    def one_value_off(src, tmp, *rest):  # a converter bug: one weight written wrong
        records = real(src, tmp, *rest)
        weights = load_file(str(tmp / "model.safetensors"))
        weights["model.norm.weight"][0] += 1
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return records

    monkeypatch.setattr(conversion, "dcp_to_hf", one_value_off)
    with pytest.raises(conversion.VerifyFailed, match="1 tensor.*model.norm.weight"):
        conversion.convert(
            entry, out, to=None, dtype="bf16", max_shard_size="5GB", force=True,
            model_config=model, check=True,
        )  # fmt: skip
    assert (out / "model.safetensors").read_bytes() == before  # the earlier output stands
    assert [p.name for p in tmp_path.iterdir()] == ["bf16"]  # no temporary folder left


def _serves(model_dir: Path, log: Path) -> None:
    port = free_port()
    argv = ["serve", str(model_dir), "--port", str(port), "--log", str(log)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_cli.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.stdout.read() if proc.poll() is not None else "timeout"
                )
                time.sleep(0.3)
        body = json.dumps(
            {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"}
        )
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert len(out["output_ids"]) >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_sharded_output_has_an_index(recover_entry: tuple[Path, Path], tmp_path: Path) -> None:
    entry, model = recover_entry
    out = tmp_path / "sharded"
    result = run_areal(
        "convert-checkpoint",
        str(entry),
        str(out),
        "--model-config",
        str(model),
        "--max-shard-size",
        "100KB",
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}


def test_bad_sources_and_destinations(recover_entry: tuple[Path, Path], tmp_path: Path) -> None:
    entry, model = recover_entry
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    refused = areal_in_process(
        "convert-checkpoint", str(entry), str(busy), "--model-config", str(model)
    )
    assert (
        refused.returncode == 2
        and "--force" in refused.stderr
        and (busy / "keep.txt").read_text() == "mine"
    )
    # --force replaces only an earlier areal output, never a folder of the user's, SRC's
    # parent, $HOME or /
    for dst, why in ((busy, "only an earlier areal output"), (entry.parent, "holds SRC"),
                     (Path.home(), "$HOME"), (Path("/"), "$HOME")):  # fmt: skip
        forced = areal_in_process(
            "convert-checkpoint", str(entry), str(dst), "--model-config", str(model), "--force"
        )
        assert forced.returncode == 2 and why in forced.stderr, forced.stderr
    assert (busy / "keep.txt").read_text() == "mine" and entry.is_dir()
    earlier = tmp_path / "earlier"
    first = run_areal("convert-checkpoint", str(entry), str(earlier), "--model-config", str(model))
    assert first.returncode == 0, first.stderr
    again = run_areal(
        "convert-checkpoint", str(entry), str(earlier), "--model-config", str(model), "--force"
    )
    assert again.returncode == 0, again.stderr  # its own earlier output: replaced
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(entry), str(broken)], check=True)
    shard = next((broken / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated shard
    out = tmp_path / "out"
    result = run_areal("convert-checkpoint", str(broken), str(out), "--model-config", str(model))
    assert (
        result.returncode == 2
        and "incomplete" in result.stderr
        and "Traceback" not in result.stderr
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    nothing = areal_in_process("convert-checkpoint", str(tmp_path / "nope"), str(out))
    assert nothing.returncode == 2 and "does not exist; give an HF folder" in nothing.stderr

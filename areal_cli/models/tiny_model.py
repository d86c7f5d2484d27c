"""Build a tiny, randomly initialised Llama-style causal LM folder, fully offline.

The folder looks like any Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat template, generation_config.json), so the
inference engine, the trainer and the tests can run end to end without a download.
The tokenizer is a byte-level BPE trained on a synthetic corpus generated in code; it does
not depend on the seed, so models built with different seeds can swap weights.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

# Each turn is "<|role|>\ncontent<|eos|>\n"; the assistant's turn ends with EOS, so a
# chat completion stops on the ordinary EOS token. Tools are Hermes-style (what Qwen's
# templates do, and what areal_cli.data.chat reads back): a system turn first names each
# function with its parameters (`Tools: add(a, b)`: compact, for a 1024-token model), an
# assistant's calls are <tool_call>{"name": ..., "arguments": {...}}</tool_call>, and a
# tool's result is a user turn inside <tool_response>. A conversation without tools
# renders as it always did.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\\nTools:' }}"
    "{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    "{{ ' ' + fn.name + '(' + (fn.get('parameters') or {}).get('properties', {}) | join(', ') + ')' }}"
    "{% endfor %}"
    '{{ \'\\nCall one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call><|eos|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>' + message['content'] + '</tool_response><|eos|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for call in message.tool_calls %}"
    "{{ '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ '<|eos|>\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|eos|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Bumped whenever the output of a given (preset, seed) changes, so a stale folder is rebuilt.
FORMAT_VERSION = 2  # 2: the chat template renders tools
MARKER_FILE = "areal_tiny_model.json"
CORPUS_SEED = 1234
# Upper bound for BPE training; the synthetic corpus runs out of merges a little below it.
# Shared by all presets, so every preset uses the same tokenizer.
TOKENIZER_VOCAB_SIZE = 1024

WORDS = (
    "the a an and or but if then so because what who where when how why which this that "
    "is are was were be been has have had do does did can will would should may might "
    "i you he she it we they me him her us them my your his its our their "
    "cat dog bird fish horse cow sheep mouse lion tiger bear wolf fox rabbit "
    "red blue green yellow black white big small long short hot cold new old good bad "
    "run walk jump swim fly eat drink sleep read write sing play think know see look "
    "house tree river sea sky sun moon star rain snow wind road city town book pen "
    "one two three four five six seven eight nine ten zero number sum answer question "
    "add plus minus times equals result total count first last next step solve check "
    "hello hi yes no please thanks sorry okay sure user assistant system help"
).split()


@dataclass(frozen=True)
class Preset:
    """Model size knobs for one preset."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    # ~1M parameters: fast enough for CPU unit tests.
    "tiny": Preset(128, 384, 4, 4, 2, 1024),
    # ~23M parameters: still CPU-friendly, big enough to learn something in a demo.
    "small": Preset(512, 1536, 7, 8, 4, 2048),
}


def _arithmetic(rng: random.Random) -> str:
    """One arithmetic fact such as "12+7=19"."""
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}={value}"


def _sentence(rng: random.Random) -> str:
    """A short sentence of random simple words."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    return " ".join(words).capitalize() + rng.choice(".?!")


def _chat(rng: random.Random) -> str:
    """A rendered chat exchange, so role markers and newlines get sensible merges."""
    question = f"What is {_arithmetic(rng).split('=')[0]}?"
    answer = _sentence(rng) if rng.random() < 0.3 else _arithmetic(rng)
    return f"<|user|>\n{question}<|eos|>\n<|assistant|>\n{answer}<|eos|>\n"


def synthetic_corpus(num_lines: int = 20000) -> Iterator[str]:
    """Deterministic training text: digits, arithmetic, simple English and chat turns."""
    rng = random.Random(CORPUS_SEED)
    yield " ".join(str(i) for i in range(1000))
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.4:
            yield " ".join(_arithmetic(rng) for _ in range(rng.randint(1, 4)))
        elif kind < 0.8:
            yield _sentence(rng)
        else:
            yield _chat(rng)


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the synthetic corpus and wrap it for transformers."""
    tok = Tokenizer(models.BPE())
    # Single digits keep arithmetic tokenisation regular; byte-level covers any input text.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=PRESETS["small"].max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _model_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The LlamaConfig for a preset, with the vocabulary taken from the tokenizer."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.hidden_size // preset.num_attention_heads,
        max_position_embeddings=preset.max_position_embeddings,
        # A wider init than the usual 0.02 gives peaked next-token distributions, so greedy
        # decoding is not decided by float rounding between near-equal logits.
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _random_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Initialise the model from `seed` without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def _marker(preset: str, seed: int) -> dict[str, object]:
    return {"format_version": FORMAT_VERSION, "preset": preset, "seed": seed}


def _is_built(out_dir: Path, preset: str, seed: int) -> bool:
    """True when `out_dir` already holds this exact (preset, seed, format) build."""
    marker = out_dir / MARKER_FILE
    try:
        return json.loads(marker.read_text()) == _marker(preset, seed)
    except (OSError, ValueError):
        return False


def _write_model(tmp: Path, preset: str, seed: int) -> None:
    """Write the full model folder into `tmp`."""
    tokenizer = build_tokenizer()
    config = _model_config(PRESETS[preset], tokenizer)
    model = _random_model(config, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # Last, so a folder with the marker is always complete.
    (tmp / MARKER_FILE).write_text(json.dumps(_marker(preset, seed), indent=2) + "\n")


def build_tiny_model(out_dir: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Build the model folder at `out_dir` atomically and return its path.

    Reuses an existing folder built with the same preset, seed and format; refuses to
    overwrite any other existing folder.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir).resolve()
    if _is_built(out_dir, preset, seed):
        return out_dir
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists and is not a '{preset}' model with seed {seed}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory, so the final rename is atomic on one filesystem.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_model(tmp, preset, seed)
        os.rename(tmp, out_dir)
    except OSError:
        # A concurrent builder may have won the race with an identical folder.
        if not _is_built(out_dir, preset, seed):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters())

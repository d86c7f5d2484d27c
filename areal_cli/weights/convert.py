"""`areal convert-checkpoint`: DCP <-> Hugging Face, streamed, verified, atomic.

Formats are detected from the source:
  DCP  a folder with `.metadata` (or a recover entry RUN/recover/step-N/ holding `dcp/`);
       model tensors are stored under `model.<hf name>`, written by any number of ranks;
       a PPO run's recover entry also holds its critic under `critic.<hf name>`, which
       `--part critic` converts (with the config of RUN/model-critic).
  HF   a folder with `config.json` and `*.safetensors`.

DCP -> HF reads one tensor at a time (DCP reads only the byte ranges of that tensor) and
streams it into safetensors shards, so peak memory stays near the largest tensor, not
the model. The config and tokenizer come from the run's model (found through the run's
config.yaml) or from --model-config. HF -> DCP writes a recover entry (`dcp/`,
`state.json` with step -1, manifest) that `areal train` can start or resume from.

DST is written under a temporary name beside it and renamed at the end, so a failure
leaves nothing half-written at DST. A non-empty DST is refused without --force. --verify
checks the temporary folder before that rename (every tensor bit for bit against SRC cast
to the output dtype, and the logits), so a failed check never replaces an earlier DST.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_cli.config.schema import torch_dtype
from areal_cli.rundir import handoff

MODEL_PREFIX = "model."


class ConvertError(Exception):
    """Bad input for the converter (exit code 2): missing, incomplete or mismatched files."""


class VerifyFailed(Exception):
    """--verify found a difference (exit code 1); nothing was written at DST."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__("; ".join(verdict.lines()))
        self.verdict = verdict


@dataclass
class Source:
    kind: str  # "dcp" or "hf"
    path: Path  # the DCP folder (with .metadata) or the HF folder
    entry: Path  # what the user named
    part: str = "model"  # DCP: which model of the checkpoint (model, or critic)

    @property
    def prefix(self) -> str:
        return f"{self.part}."


def detect(src: Path, part: str = "model") -> Source:
    """Work out the format of `src`, or raise ConvertError saying what is missing."""
    if not src.exists():
        raise ConvertError(f"source not found: {src}")
    for candidate in (src, src / "dcp"):
        if (candidate / ".metadata").is_file():
            return Source("dcp", candidate, src, part)
    if (src / "config.json").is_file():
        if not list(src.glob("*.safetensors")):
            raise ConvertError(
                f"{src} has config.json but no .safetensors files (incomplete HF folder)"
            )
        return Source("hf", src, src)
    raise ConvertError(
        f"{src} is neither a DCP checkpoint (no .metadata) nor an HF folder (no config.json)"
    )


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1024' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConvertError(f"cannot read size '{text}'; write e.g. 2GB or 500MB")
    units = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    unit = (match.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(match.group(1)) * units[unit])


# ---------------------------------------------------------------- DCP -> HF


def _dcp_model_tensors(
    dcp_dir: Path, prefix: str = MODEL_PREFIX
) -> list[tuple[str, torch.Size, torch.dtype]]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata
        raise ConvertError(f"cannot read DCP metadata in {dcp_dir}: {exc}") from exc
    out = []
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(meta, "size"):
            out.append((key[len(prefix) :], meta.size, meta.properties.dtype))
    if not out:
        what = "not an areal recover checkpoint" if prefix == MODEL_PREFIX else "not a PPO run's"
        raise ConvertError(f"{dcp_dir} holds no {prefix}* tensors ({what})")
    out.sort(key=lambda spec: spec[0])  # a stable order makes conversions byte-reproducible
    for item in metadata.storage_data.values():
        path = dcp_dir / item.relative_path
        if not path.is_file() or path.stat().st_size < item.offset + item.length:
            raise ConvertError(
                f"DCP checkpoint {dcp_dir} is incomplete: {item.relative_path} is missing or truncated"
            )
    return out


def iter_dcp_tensors(
    dcp_dir: Path,
    dtype: torch.dtype | None = None,
    group_bytes: int = 64 << 20,
    prefix: str = MODEL_PREFIX,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs read from a DCP checkpoint, in name order.

    Tensors are loaded in groups of about `group_bytes` (one DCP read per group, which only
    touches those tensors' byte ranges), so memory stays near max(group, largest tensor)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(dcp_dir))
    group: list[tuple[str, torch.Size, torch.dtype]] = []
    size = 0

    def load(specs: list) -> Iterator[tuple[str, torch.Tensor]]:
        target = {prefix + n: torch.empty(s, dtype=d) for n, s, d in specs}
        dcp.load(target, storage_reader=reader, no_dist=True)
        for name, _, _ in specs:
            tensor = target.pop(prefix + name)
            yield name, tensor.to(dtype) if dtype is not None else tensor

    for spec in _dcp_model_tensors(dcp_dir, prefix):
        n_bytes = spec[1].numel() * torch.empty((), dtype=spec[2]).element_size()
        if group and size + n_bytes > group_bytes:
            yield from load(group)
            group, size = [], 0
        group.append(spec)
        size += n_bytes
    if group:
        yield from load(group)


def find_model_dir(src: Source, override: Path | None) -> Path:
    """Where config.json and the tokenizer come from for DCP -> HF."""
    if override is not None:
        if not (override / "config.json").is_file():
            raise ConvertError(f"--model-config {override} has no config.json")
        return override
    from areal_cli.config.loader import load_config
    from areal_cli.rundir.layout import initial_model_path
    from areal_cli.rundir.paths import RunDir

    for parent in [src.entry, *src.entry.parents][:4]:
        config = RunDir(parent).config
        if config.is_file():
            cfg = load_config(config).config
            model = Path(initial_model_path(cfg, parent))
            if cfg.algorithm == "rm" and RunDir(parent).scalar_model.is_dir():
                model = RunDir(parent).scalar_model  # what the reward model trained
            if src.part == "critic":  # RUN/model-critic, unless critic.path had a head
                made = RunDir(parent).critic_model
                model = made if made.is_dir() or not cfg.critic.path else Path(cfg.critic.path)
            if (model / "config.json").is_file():
                return model
    raise ConvertError(
        f"cannot find the model config for {src.entry}; pass --model-config MODEL_DIR"
    )


def dcp_to_hf(
    src: Source, tmp: Path, model_dir: Path, dtype: torch.dtype | None, max_shard: int
) -> list[handoff.FileRecord]:
    """Stream a DCP checkpoint into HF safetensors shards plus config and tokenizer."""
    from areal_cli.models.lora import is_adapter_key
    from areal_cli.rundir.safetensors_io import StreamingWriter

    specs = _dcp_model_tensors(src.path, src.prefix)
    if any(is_adapter_key(name) for name, _, _ in specs):
        raise ConvertError(
            f"{src.entry} is a LoRA run's recover entry: it holds the adapters, not the "
            "frozen base; convert the run's adapter folders (checkpoints/step-N, "
            "weights/vN) with --merge-lora instead"
        )
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        specs = [s for s in specs if s[0] != "lm_head.weight"]
    shards = _plan_shards([(n, s, dtype or d) for n, s, d in specs], max_shard)
    names = _shard_names(len(shards))
    records, weight_map = [], {}
    tensors = iter_dcp_tensors(src.path, dtype, prefix=src.prefix)
    for shard, file_name in zip(shards, names, strict=True):
        writer = StreamingWriter(tmp, file_name, [(n, d, tuple(s)) for n, s, d in shard])
        for name, _, _ in shard:
            got, tensor = next(tensors)
            while got not in {n for n, _, _ in shard}:  # skipped (tied) tensors
                got, tensor = next(tensors)
            writer.put(tensor)
            weight_map[name] = file_name
        records.append(writer.close())
    if len(shards) > 1:
        total = sum(
            s.numel() * torch.empty((), dtype=d).element_size()
            for _, s, d in (x for sh in shards for x in sh)
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        records.append(
            handoff.write_bytes(
                tmp, "model.safetensors.index.json", json.dumps(index, indent=1).encode()
            )
        )
    return records + _model_files(tmp, model_dir, config, dtype)


def _model_files(
    tmp: Path, model_dir: Path, config: dict, dtype: torch.dtype | None
) -> list[handoff.FileRecord]:
    """Config, generation config and tokenizer files of `model_dir` into `tmp`; the
    config names `dtype` when the weights were cast."""
    from areal_cli.rundir.layout import model_files_to_copy

    records = []
    for src_file in model_files_to_copy(model_dir):
        data = src_file.read_bytes()
        if src_file.name == "config.json" and dtype is not None:
            config = {**config, "dtype": str(dtype).removeprefix("torch.")}
            data = json.dumps(config, indent=2).encode()
        records.append(handoff.write_bytes(tmp, src_file.name, data))
    return records


def _finish(tmp: Path, dst: Path, records: list[handoff.FileRecord], meta: dict) -> None:
    """The output's manifest into `tmp`, fsynced (before any check reads it)."""
    manifest = {"name": dst.name, "version": 0, "meta": meta, "files": [vars(r) for r in records]}
    handoff.write_json_atomic(tmp / handoff.MANIFEST, manifest)
    handoff.fsync_dir(tmp)


def _put_in_place(tmp: Path, dst: Path) -> None:
    """Rename the checked output over DST (an earlier output, when --force)."""
    if dst.exists():
        handoff.remove_entry(dst) if dst.is_dir() else dst.unlink()
    os.rename(tmp, dst)
    handoff.fsync_dir(dst.parent)


def _plan_shards(specs: list[tuple[str, torch.Size, torch.dtype]], max_shard: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        n_bytes = spec[1].numel() * torch.empty((), dtype=spec[2]).element_size()
        if shards[-1] and size + n_bytes > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n_bytes
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# ---------------------------------------------------------------- HF -> DCP


def iter_hf_tensors(
    hf_dir: Path, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an HF folder, one at a time (memory-mapped reads)."""
    from safetensors import safe_open

    for file in sorted(hf_dir.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor = f.get_tensor(name)
                    yield name, tensor.to(dtype) if dtype is not None else tensor
        except Exception as exc:  # truncated or not a safetensors file
            raise ConvertError(f"cannot read {file}: {exc}") from exc


def hf_to_dcp(src: Source, tmp: Path, dtype: torch.dtype | None) -> list[handoff.FileRecord]:
    """Write an HF folder as a recover entry (dcp/ + state.json) the trainer can load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {
        MODEL_PREFIX + name: tensor
        for name, tensor in sorted(iter_hf_tensors(src.path, dtype), key=lambda kv: kv[0])
    }
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp / "dcp")), no_dist=True)
    handoff.write_json_atomic(tmp / "state.json", {"step": -1, "source": str(src.path)})
    return handoff.record_tree(tmp)


# ---------------------------------------------------------------- entry point


FORMAT_WORDS = {"hf": "hf", "huggingface": "hf", "safetensors": "hf", "dcp": "dcp"}


def named_format(folder: Path) -> str | None:
    """The format a folder's name suggests ("hf_out" -> hf, "model-dcp" -> dcp), if any."""
    import re

    words = {FORMAT_WORDS.get(w) for w in re.split(r"[^a-z0-9]+", folder.name.lower())}
    found = words - {None}
    return found.pop() if len(found) == 1 else None


FORMAT_NAMES = {"hf": "HF folder", "dcp": "DCP checkpoint"}
ARTICLE = {"hf": "an", "dcp": "a"}


def convert(
    src_path: Path,
    dst: Path,
    *,
    to: str | None,
    dtype: str | None,
    max_shard_size: str,
    force: bool,
    model_config: Path | None,
    part: str = "model",
    check: bool = False,
) -> tuple[Source, Path, Verdict | None]:
    """Convert SRC into DST atomically; returns the detected source, DST and, with
    `check`, the verdict of `verify`. The output is verified in its temporary folder and
    renamed into place only when it passes, so a failed check replaces nothing
    (VerifyFailed carries the verdict)."""
    import warnings

    # transformers is imported by `verify` only (its import is about a second of the
    # conversion's CPU; nothing else here uses it).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    src = detect(src_path, part)
    if part != "model" and src.kind != "dcp":
        raise ConvertError(f"--part {part} picks a model inside a DCP checkpoint; {src_path} is HF")
    target = to or ("hf" if src.kind == "dcp" else "dcp")
    named = named_format(dst)
    if to is None and named is not None and named != target:
        raise ConvertError(
            f"{dst.name} reads like {ARTICLE[named]} {FORMAT_NAMES[named]}, but {src_path} is already "
            f"{src.kind.upper()}, so it would become {target.upper()}; pass --to {target} "
            "to write that, or name the output otherwise"
        )
    if target == src.kind:
        raise ConvertError(
            f"{src_path} is already {src.kind.upper()}; use --to {'hf' if target == 'dcp' else 'dcp'}"
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not force:
            raise ConvertError(f"{dst} exists and is not empty; pass --force to replace it")
        _check_replaceable(dst, src_path)
    to_dtype = torch_dtype(dtype) if dtype else None
    max_shard = parse_size(max_shard_size)
    model_dir = find_model_dir(src, model_config) if target == "hf" else None
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".tmp-{dst.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if target == "hf":
            records = dcp_to_hf(src, tmp, model_dir, to_dtype, max_shard)
        else:
            records = hf_to_dcp(src, tmp, to_dtype)
        _finish(tmp, dst, records, {"converted_from": str(src.entry), "format": target})
        verdict = verify(tmp, src) if check else None
        if verdict is not None and not verdict.ok:
            raise VerifyFailed(verdict)
        _put_in_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return src, dst, verdict


def _check_replaceable(dst: Path, src: Path) -> None:
    """--force replaces only an earlier output of areal (a folder with its manifest.json),
    and never /, the home folder, SRC itself or a folder that holds SRC."""
    real, source = dst.resolve(), src.resolve()
    protected = {Path("/"), Path.home().resolve()}
    if real in protected or real == source or source.is_relative_to(real):
        raise ConvertError(f"--force will not delete {dst}: it is /, $HOME, SRC or holds SRC")
    if not real.is_dir() or not (real / handoff.MANIFEST).is_file():
        raise ConvertError(
            f"--force replaces only an earlier areal output (a folder with {handoff.MANIFEST}); "
            f"{dst} is not one, so remove it yourself or choose another DST"
        )


# Two models with the same weights give the same logits: the converted side is compared
# with SRC cast to the converted dtype, so any dtype gets this one tolerance (fp32 math).
VERIFY_TOLERANCE = 1e-4


@dataclass
class Verdict:
    """What --verify found: the converted tensors against SRC cast to their dtype."""

    dtype: torch.dtype  # of the converted tensors
    mismatched: list[str]  # tensors that are not bit-equal to SRC cast to `dtype`
    diff: float  # max |logit difference| against SRC cast to `dtype`
    rounding: float  # max |logit difference| against SRC as stored: the cast's own cost

    @property
    def ok(self) -> bool:
        return not self.mismatched and self.diff <= VERIFY_TOLERANCE

    def lines(self) -> list[str]:
        name = str(self.dtype).removeprefix("torch.")
        out = [
            f"verify: max |logit difference| = {self.diff:.3g} against SRC cast to {name} "
            f"(tolerance {VERIFY_TOLERANCE:g}); {self.rounding:.3g} against SRC as stored"
            + (f" (the cost of rounding to {name})" if self.rounding > VERIFY_TOLERANCE else "")
        ]
        if self.mismatched:
            out.append(
                f"verify: {len(self.mismatched)} tensor(s) differ from SRC cast to {name}: "
                + ", ".join(self.mismatched[:5])
            )
        return out


def verify(out: Path, src: Source) -> Verdict:
    """Compare the converted folder `out` with SRC: every tensor bit for bit against SRC
    cast to the converted dtype, and the logits on a fixed input (fp32 math; for a scalar
    head, the head's output at every position) against SRC so cast and as stored."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from areal_cli.config.model_info import is_scalar_config

    hf_logging.disable_progress_bar()
    converted = detect(out)
    hf_dir = out if src.kind == "dcp" else src.path
    config = AutoConfig.from_pretrained(hf_dir)
    new = dict(_tensors(converted))
    old = dict(_tensors(src))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    names = set(new) | set(old)
    if tied:
        names.discard("lm_head.weight")
    missing = sorted(n for n in names if n not in new or n not in old)
    if missing:
        raise ConvertError(f"the two sides hold different tensors: {missing[:3]}")
    dtype = next(iter(new.values())).dtype
    mismatched = [n for n in sorted(names) if not torch.equal(old[n].to(dtype), new[n])]
    auto = (
        AutoModelForSequenceClassification
        if is_scalar_config(config.to_dict())
        else AutoModelForCausalLM
    )
    ids = (torch.arange(32) * 7919 % config.vocab_size).unsqueeze(0)

    def logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
        model = auto.from_config(config, dtype=torch.float32).eval()
        loaded = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        absent = [m for m in loaded.missing_keys if not (tied and m == "lm_head.weight")]
        if absent or loaded.unexpected_keys:
            raise ConvertError(
                f"the checkpoint does not fit its config: missing {absent[:3]}, "
                f"unexpected {loaded.unexpected_keys[:3]}"
            )
        if tied:
            model.tie_weights()
        with torch.no_grad():
            if auto is AutoModelForSequenceClassification:  # every position, not the pooled one
                return model.score(model.base_model(input_ids=ids).last_hidden_state)
            return model(input_ids=ids).logits

    converted_logits = logits(new)
    cast = {k: v.to(dtype) for k, v in old.items()}
    return Verdict(
        dtype,
        mismatched,
        float((converted_logits - logits(cast)).abs().max()),
        float((converted_logits - logits(old)).abs().max()),
    )


def _tensors(side: Source) -> Iterator[tuple[str, torch.Tensor]]:
    """A side's tensors as stored (DCP: its model part)."""
    if side.kind == "dcp":
        return iter_dcp_tensors(side.path, None, prefix=side.prefix)
    return iter_hf_tensors(side.path)


# ---------------------------------------------------------------- LoRA -> HF (--merge-lora)


def adapter_base(adapter: Path, override: Path | None) -> Path:
    """The base model folder of a LoRA adapter folder: --model-config, else the one its
    adapter_config.json names (a local folder with its weights)."""
    from areal_cli.rundir.layout import adapter_base_model

    try:
        base = override if override is not None else adapter_base_model(adapter)
    except ValueError as exc:
        raise ConvertError(f"{exc}; pass --model-config BASE_DIR") from None
    if not (base / "config.json").is_file() or not list(base.glob("*.safetensors")):
        raise ConvertError(
            f"the base model {base} is not an HF folder on this machine; pass --model-config BASE_DIR"
        )
    return base


def merge_lora(
    src: Path,
    dst: Path,
    *,
    dtype: str | None,
    max_shard_size: str,
    force: bool,
    model_config: Path | None,
    check: bool = False,
) -> tuple[Path, float | None]:
    """Write the LoRA adapter folder SRC merged into its base model as an HF folder DST
    (atomically, as `convert`), one tensor at a time; the merge is models.lora's, the
    one the embedded server applies. With `check`, the max |logit difference| between
    DST and the base with the adapter applied on the fly (VerifyFailed above
    VERIFY_TOLERANCE, and DST is left as it was)."""
    from areal_cli.models.lora import AdapterError, read_adapter

    try:
        adapter = read_adapter(src)
    except AdapterError as exc:
        raise ConvertError(str(exc)) from exc
    base = adapter_base(src, model_config)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not force:
            raise ConvertError(f"{dst} exists and is not empty; pass --force to replace it")
        _check_replaceable(dst, src)
    to_dtype = torch_dtype(dtype) if dtype else None
    config = json.loads((base / "config.json").read_text())
    specs = []
    for name, tensor in iter_hf_tensors(base):
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        specs.append((name, tensor.shape, to_dtype or tensor.dtype))
    adapted = {f"{m}.weight" for m in adapter.modules()}
    absent = sorted(adapted - {n for n, _, _ in specs})
    if absent:
        raise ConvertError(f"the adapter adapts {absent[:3]}, which {base} lacks (another base?)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".tmp-{dst.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        records = _write_merged(tmp, base, adapter, specs, parse_size(max_shard_size))
        records += _model_files(tmp, base, config, to_dtype)
        _finish(
            tmp, dst, records, {"merged_from": str(src), "base_model": str(base), "format": "hf"}
        )
        diff = _merged_logit_diff(tmp, base, adapter) if check else None
        if diff is not None and diff > VERIFY_TOLERANCE:
            raise VerifyFailed(Verdict(specs[0][2], [], diff, diff))
        _put_in_place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst, diff


def _write_merged(
    tmp: Path, base: Path, adapter: Any, specs: list, max_shard: int
) -> list[handoff.FileRecord]:
    """The base's tensors into safetensors shards in `tmp`, one at a time, each adapted
    one merged (models.lora.merged_weight) on its way."""
    from areal_cli.models.lora import merged_weight
    from areal_cli.rundir.safetensors_io import StreamingWriter

    shards = _plan_shards(specs, max_shard)
    adapted = {f"{m}.weight" for m in adapter.modules()}
    records, weight_map = [], {}
    tensors = iter_hf_tensors(base)  # in the order `specs` was made
    for shard, file_name in zip(shards, _shard_names(len(shards)), strict=True):
        writer = StreamingWriter(tmp, file_name, [(n, d, tuple(s)) for n, s, d in shard])
        for name, _, out_dtype in shard:
            got, tensor = next(tensors)
            while got != name:  # a tied lm_head, left out
                got, tensor = next(tensors)
            if name in adapted:
                module = name.removesuffix(".weight")
                a, b = adapter.tensors[f"{module}.lora_A"], adapter.tensors[f"{module}.lora_B"]
                tensor = merged_weight(tensor, a, b, adapter.spec.scale)
            writer.put(tensor.to(out_dtype))
            weight_map[name] = file_name
        records.append(writer.close())
    if len(shards) > 1:
        data = json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1).encode()
        records.append(handoff.write_bytes(tmp, "model.safetensors.index.json", data))
    return records


def _merged_logit_diff(merged: Path, base: Path, adapter) -> float:
    """Max |logit difference| (fp32) between the merged folder and the base model with
    the adapter applied on the fly (models.lora's layer), on a fixed input."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from areal_cli.models import lora

    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(base)
    ids = (torch.arange(32) * 7919 % config.vocab_size).unsqueeze(0)
    on_the_fly = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    lora.inject(
        on_the_fly, lora.LoraSpec(adapter.spec.rank, adapter.spec.alpha, tuple(adapter.modules()))
    )
    on_the_fly.load_state_dict(adapter.tensors, strict=False)
    folded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        return float((on_the_fly(input_ids=ids).logits - folded(input_ids=ids).logits).abs().max())

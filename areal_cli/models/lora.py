"""LoRA adapters: the layer the trainer trains, PEFT's folder layout, and the merge.

A LoRA adapter adds to a frozen linear layer W a low-rank update, y = W x + s * B (A x)
with A [r, in], B [out, r] and s = alpha / r (Hu et al. 2021; PEFT's `LoraLayer`, whose
initialisation we follow: A Kaiming-uniform, B zero, so a fresh adapter changes nothing).

Why our own layer and not PEFT's: PEFT wraps the model (`base_model.model.` prefixes,
`base_layer` renames) and imports transformers' modeling stack; the trainer's checkpoint
names, FSDP2 wrap classes, tensor-parallel plan and exports all speak the base model's
own names, and the GPU machine and the embedded server carry no PEFT. `LoraLinear` is a
`nn.Linear` (same `weight`/`bias` names) with two more parameters, so everything that
reads the base model's names still does. What crosses to other tools is PEFT's layout,
exactly: `adapter_config.json` + `adapter_model.safetensors` with PEFT's key names
(`peft_key`), which PEFT, SGLang and vLLM load (tests load ours with PEFT itself).

Targets follow PEFT's matching: `all-linear` is every linear layer but the output head;
a list names module-name suffixes (`q_proj` matches `model.layers.0.self_attn.q_proj`).

The merge `merged_weight` is the one formula every consumer uses (the embedded server
on load, `convert-checkpoint --merge-lora`), computed in float32 and cast to the base
weight's dtype, so a merged checkpoint and a server that loaded the adapter agree.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from areal_cli.rundir.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

ALL_LINEAR = "all-linear"
_PEFT_PREFIX = "base_model.model."
_OUTPUT_HEADS = ("lm_head", "score")  # PEFT's all-linear leaves the output layer out


class AdapterError(ValueError):
    """An adapter folder that cannot be used (the message says what is wrong and where)."""


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA adapter is: its rank, alpha and the module names it targets (as given:
    `all-linear`, or suffixes)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        """s in W x + s * B (A x)."""
        return self.alpha / self.rank

    def peft_config(self, modules: Sequence[str], base_model: str) -> dict[str, Any]:
        """adapter_config.json in PEFT's form; `modules` are the matched module names,
        written as PEFT writes them (their distinct last components)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
        }


def spec_of(actor: Any) -> LoraSpec | None:
    """The adapter an actor config (`TrainEngineConfig`) asks for; None without use_lora."""
    if not actor.use_lora:
        return None
    return LoraSpec(actor.lora_rank, float(actor.lora_alpha), tuple(actor.target_modules))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of an injected model by state-dict key (sharded ones as they are)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def linear_modules(model: nn.Module) -> list[str]:
    """Names of the model's linear layers that `all-linear` covers (not the output head)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in _OUTPUT_HEADS
    ]


def select(candidates: Iterable[str], targets: Sequence[str]) -> list[str]:
    """The module names among `candidates` that `targets` match (PEFT's rule: `all-linear`
    takes every one; otherwise a name matches a target it equals or ends with `.target`;
    a single string target is a full regular expression, as PEFT reads it)."""
    names = list(candidates)
    if list(targets) == [ALL_LINEAR]:
        return names
    if isinstance(targets, str):
        return [n for n in names if re.fullmatch(targets, n)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]


def unmatched(candidates: Iterable[str], targets: Sequence[str]) -> list[str]:
    """The targets that match no module among `candidates` (`all-linear` matches if any
    linear layer exists)."""
    names = list(candidates)
    if list(targets) == [ALL_LINEAR]:
        return [] if names else [ALL_LINEAR]
    return [t for t in targets if not select(names, [t])]


class LoraLinear(nn.Linear):
    """A linear layer with a LoRA adapter: `weight`/`bias` as in nn.Linear (frozen by the
    trainer), and `lora_A` [r, in], `lora_B` [out, r] beside them."""

    def __init__(self, base: nn.Linear, rank: int, scale: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + update * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def inject(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Replace each targeted linear layer of `model` by a `LoraLinear` (its new parameters
    on the base weight's device, uninitialised: meta on a meta model); freeze everything
    but the adapters. Returns the adapted module names; raises AdapterError when a target
    matches nothing."""
    candidates = linear_modules(model)
    missing = unmatched(candidates, spec.target_modules)
    if missing:
        raise AdapterError(
            f"LoRA target(s) {missing} match no linear layer of the model "
            f"(its layers end in {sorted({c.rsplit('.', 1)[-1] for c in candidates})})"
        )
    chosen = select(candidates, spec.target_modules)
    model.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoraLinear(getattr(parent, child), spec.rank, spec.scale)
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)
        setattr(parent, child, layer)
    return chosen


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key of an injected model is an adapter's (`...lora_A`)."""
    return key.endswith((".lora_A", ".lora_B"))


def initial_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The fresh adapters of an injected model, the same on every rank (a generator seeded
    with `seed`): A as PEFT initialises it (Kaiming-uniform, a = sqrt(5)), B zero. Full
    tensors on the CPU, by state-dict key, for the trainer to copy its shards out of."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        rank, fan_in = module.lora_A.shape
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_ with a = sqrt(5): gain^2 = 1/3
        a = (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound
        state[f"{name}.lora_A"] = a.to(module.lora_A.dtype)
        state[f"{name}.lora_B"] = torch.zeros(module.lora_B.shape, dtype=module.lora_B.dtype)
    return state


def peft_key(key: str) -> str:
    """Our key (`model.layers.0.self_attn.q_proj.lora_A`) as PEFT saves it
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return f"{_PEFT_PREFIX}{key}.weight"


def our_key(key: str) -> str:
    """The inverse of `peft_key`; raises AdapterError for a key PEFT's LoRA does not write."""
    if not (key.startswith(_PEFT_PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))):
        raise AdapterError(f"{key!r} is not a LoRA weight in PEFT's layout")
    return key[len(_PEFT_PREFIX) : -len(".weight")]


def write_adapter(
    folder: Path, tensors: dict[str, torch.Tensor], spec: LoraSpec, base_model: str
) -> list:
    """Write PEFT's adapter files into `folder` (fsynced); `tensors` by our keys. Returns
    the files' handoff records."""
    from areal_cli.rundir.handoff import write_bytes
    from areal_cli.rundir.safetensors_io import write_safetensors

    modules = sorted({k.rsplit(".", 1)[0] for k in tensors})
    config = spec.peft_config(modules, base_model)
    weights = {peft_key(k): v.detach().contiguous() for k, v in sorted(tensors.items())}
    return [
        write_safetensors(folder, ADAPTER_WEIGHTS, weights),
        write_bytes(folder, ADAPTER_CONFIG, (json.dumps(config, indent=1) + "\n").encode()),
    ]


@dataclass(frozen=True)
class Adapter:
    """An adapter read from a folder: its spec, its base model, and its tensors by our
    keys (float32 on the CPU)."""

    spec: LoraSpec
    base_model: str
    tensors: dict[str, torch.Tensor]

    def modules(self) -> list[str]:
        """The adapted module names."""
        return sorted({k.rsplit(".", 1)[0] for k in self.tensors})


def read_adapter(folder: Path) -> Adapter:
    """Read and check PEFT's adapter files; raises AdapterError naming the file and the
    problem (corrupt, truncated, not LoRA, a variant we do not apply)."""
    from areal_cli.rundir.safetensors_io import read_tensors

    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path}: peft_type must be LORA")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{config_path}: {flag} adapters are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{config_path}: modules_to_save is not supported")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{config_path}: needs integer r and lora_alpha ({exc})") from exc
    try:
        loaded, _ = read_tensors(weights_path, None)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {weights_path}: {exc}") from exc
    tensors = {our_key(k): v.float() for k, v in loaded.items()}
    for module in {k.rsplit(".", 1)[0] for k in tensors}:
        a, b = tensors.get(f"{module}.lora_A"), tensors.get(f"{module}.lora_B")
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"{weights_path}: {module} needs lora_A [{rank}, in] and lora_B [out, {rank}]"
            )
    targets = config.get("target_modules") or []
    spec = LoraSpec(rank, alpha, (targets,) if isinstance(targets, str) else tuple(targets))
    return Adapter(spec, str(config.get("base_model_name_or_path") or ""), tensors)


def merged_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
) -> torch.Tensor:
    """W + s * B A, computed in float32, in the base weight's dtype (see the module doc)."""
    delta = (b.float() @ a.float()) * scale
    return (base.float() + delta).to(base.dtype)


def merge_into(weights: dict[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """`weights` (a base model's tensors by checkpoint name) with the adapter merged into
    every module it adapts; raises AdapterError when it adapts a module the model lacks or
    whose shape differs."""
    merged = dict(weights)
    for module in adapter.modules():
        name = f"{module}.weight"
        a, b = adapter.tensors[f"{module}.lora_A"], adapter.tensors[f"{module}.lora_B"]
        base = weights.get(name)
        if base is None:
            raise AdapterError(f"the adapter adapts {module}, which the base model lacks")
        if tuple(base.shape) != (b.shape[0], a.shape[1]):
            raise AdapterError(
                f"{module}: adapter {b.shape[0]}x{a.shape[1]} does not fit the base weight "
                f"{list(base.shape)} (another base model?)"
            )
        merged[name] = merged_weight(base, a, b, adapter.spec.scale)
    return merged

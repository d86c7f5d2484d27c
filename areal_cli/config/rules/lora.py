"""The rules of LoRA (`actor.use_lora`): what it trains, where it runs, and whether its
targets exist in the model.

Built: the RL actor of algorithm grpo on FSDP2 (d and c), versions sent through disk
(PEFT adapter folders) to the embedded server, SGLang and vLLM, or over the weight-update
group (the adapter tensors only) to the embedded server. Refused, each in one line: the
other roles (a PPO critic, a reward model and SFT would train whole models beside it, or
are not built with adapters), tensor parallelism (the adapters' A and B would need their
own split), and the distributed weight update to SGLang or vLLM (their group routes
update base weights, not adapters).
"""

from __future__ import annotations

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.checker import Checker
from areal_cli.config.model_info import model_config

LORA_KEYS = ("lora_rank", "lora_alpha", "target_modules", "peft_type")
# The linear layers of the Llama family (llama, mistral, qwen2, qwen3), by module name.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_lora(c: Checker, mode: AllocationMode | None) -> None:
    """Every LoRA rule; LoRA's keys without use_lora are a warning (they do nothing)."""
    a = c.cfg.actor
    if not a.use_lora:
        for key in LORA_KEYS:
            if ("actor", key) in c.loaded.locations:
                c.warn(f"actor.{key}", "is read only with actor.use_lora: true", "remove it")
        return
    if c.cfg.algorithm != "grpo":
        c.error(
            "actor.use_lora",
            f"LoRA is built for the RL actor of algorithm: grpo, not for algorithm: "
            f"{c.cfg.algorithm}",
            "set algorithm: grpo, or drop actor.use_lora",
        )
    if mode is not None and mode.train is not None and mode.train.tensor_parallel_size > 1:
        c.error(
            "allocation_mode",
            "LoRA (actor.use_lora) with tensor parallelism (t > 1) is not built",
            f"drop t from '{c.cfg.allocation_mode}' (LoRA's optimizer state is small: d alone fits)",
        )
    backend = mode.inference_backend if mode is not None else None
    if a.weight_update.distributed and backend not in (None, "embedded"):
        c.error(
            "actor.weight_update.method",
            f"{a.weight_update.method} is built for LoRA adapters on the embedded server "
            f"only, not on {backend}",
            "use method: disk (an adapter version is a few MB: PEFT's folder on disk)",
        )
    if c.valid("actor.target_modules", "model.path"):
        _check_targets(c)


def _check_targets(c: Checker) -> None:
    """Each target must name a linear layer of a Llama-family model (other architectures
    are checked when the trainer builds the model)."""
    targets = list(c.cfg.actor.target_modules)
    if not targets:
        c.error("actor.target_modules", "is empty", "give all-linear, or names such as q_proj")
        return
    if targets == ["all-linear"]:
        return
    if "all-linear" in targets:
        c.error(
            "actor.target_modules",
            "all-linear must be the only entry",
            "give [all-linear], or module names only",
        )
        return
    config = model_config(c.cfg.model.path)
    if not config or config.get("model_type") not in LLAMA_TYPES:
        return
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in LLAMA_LINEARS]
    if missing:
        c.error(
            "actor.target_modules",
            f"{missing} match no linear layer of this {config['model_type']} model",
            f"choose among all-linear, {', '.join(LLAMA_LINEARS)}",
        )

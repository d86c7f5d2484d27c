"""What a colocated run (`a|b`) holds on each shared device in each phase, estimated from
the model's config.json for `areal train --dry-run` (no torch: the sizes are arithmetic).

  rollout   a server's weights and KV cache; the trainer's state is in host memory
            (on a CPU everything is host memory);
  training  a trainer rank's shard of the parameters, the gradients and the optimizer
            state (activations come on top and depend on the micro-batch); the servers
            have released theirs.
The KV cache of the embedded server is its worst case: as many rows as it runs at once
(max_running_requests, at most a batch's samples), each of the longest sequence (a
single-turn rollout's prompt and reply: max_prompt_len + max_new_tokens; else the
context); SGLang and vLLM reserve a fraction of the GPU instead, which is shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.schema import ExperimentConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def size(n: int) -> str:
    """Bytes for people: MiB below a GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _heads(config: dict) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head size) of a config.json."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    return heads, kv, config.get("head_dim") or config["hidden_size"] // heads


def param_count(config: dict) -> int:
    """Parameters of a Llama-style decoder described by its config.json."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv, hd = _heads(config)
    attention = 2 * h * heads * hd + 2 * h * kv * hd
    mlp = 3 * h * config["intermediate_size"]
    embeddings = config["vocab_size"] * h
    head = 0 if config.get("tie_word_embeddings", False) else embeddings
    return layers * (attention + mlp + 2 * h) + embeddings + head + h


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a Llama-style block, by its name."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = _heads(config)
    return {
        "q_proj": (h, heads * hd),
        "k_proj": (h, kv * hd),
        "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def lora_param_count(config: dict, rank: int, targets: list[str]) -> int:
    """Parameters of rank-`rank` LoRA adapters on the `targets` of a Llama-style decoder
    (all-linear: all seven linear layers of every block; a name it does not know, or a
    regular expression, counts as all of them: an upper bound)."""
    shapes = linear_shapes(config)
    known = [t for t in targets if t in shapes]
    chosen = list(shapes) if targets == ["all-linear"] or len(known) < len(targets) else known
    per_layer = sum(rank * (shapes[n][0] + shapes[n][1]) for n in chosen)
    return config["num_hidden_layers"] * per_layer


def trained_params(cfg: ExperimentConfig, config: dict) -> int:
    """Parameters that get gradients and optimizer state: all of them, or with
    actor.use_lora the adapters only."""
    a = cfg.actor
    if a.use_lora:
        return lora_param_count(config, a.lora_rank, list(a.target_modules))
    return param_count(config)


def frozen_models(cfg: ExperimentConfig, config: dict) -> dict[str, int]:
    """The frozen models the trainer ranks hold beside the actor, and their parameters:
    the reference (DPO, or actor.kl_ctl > 0) and the distillation teacher (when its
    config.json is on this machine)."""
    from areal_cli.config.model_info import model_config

    out = {}
    rl = cfg.algorithm in ("grpo", "ppo")
    if cfg.algorithm == "dpo" or (rl and cfg.actor.kl_ctl > 0):
        out["reference"] = param_count(config)
    teacher = model_config(cfg.teacher.path) if rl and cfg.teacher.path else None
    if teacher and "num_attention_heads" in teacher:
        out["teacher"] = param_count(teacher)
    return out


def trainer_state_bytes(cfg: ExperimentConfig, config: dict, world_size: int) -> int:
    """One trainer rank's parameters, gradients and optimizer state (float32 Adam moments)
    under FSDP2 over `world_size` ranks (tensor parallelism splits each shard further),
    with the frozen models' parameters, sharded alike."""
    train_bytes = DTYPE_BYTES.get(cfg.model.dtype, 4)
    optimizer = 8 if cfg.actor.optimizer.type == "adamw" else 0  # two float32 moments
    params = param_count(config) + sum(frozen_models(cfg, config).values())
    if cfg.actor.use_lora:
        params += trained_params(cfg, config)  # the adapters sit beside the frozen base
    total = params * train_bytes + trained_params(cfg, config) * (train_bytes + optimizer)
    return total // world_size


def trainer_line(cfg: ExperimentConfig, config: dict, world_size: int) -> str:
    """The dry run's line on a trainer rank's state."""
    state = size(trainer_state_bytes(cfg, config, world_size))
    n, trained = param_count(config), trained_params(cfg, config)
    if cfg.actor.use_lora:
        what = (
            f"LoRA: gradients and optimizer state for {trained / 1e6:.2f}M adapter parameters "
            f"({100 * trained / n:.2f}% of the model's {n / 1e6:.1f}M)"
        )
    else:
        what = f"gradients and optimizer state for all {n / 1e6:.1f}M parameters"
    frozen = frozen_models(cfg, config)
    if frozen:
        what += "; frozen " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in frozen.items())
    return f"trainer state per rank: {state} ({what}; activations on top)"


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    _, kv, hd = _heads(config)
    return 2 * config["num_hidden_layers"] * kv * hd * dtype_bytes


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes per shared device (GPU, or the host on a CPU) in each phase."""

    server_weights: int
    server_kv: int | None  # None: the backend reserves `reserved_fraction` of the GPU
    reserved_fraction: float
    trainer_state: int  # parameters + gradients + optimizer state, one rank's shard

    def lines(self, device: str) -> list[str]:
        where = "the host" if device == "cpu" else "each GPU"
        kv = (
            f"a KV cache of up to {size(self.server_kv)}"
            if self.server_kv is not None
            else f"a KV cache in the {self.reserved_fraction:g} of the GPU it reserves"
        )
        host = "in host memory" if device != "cpu" else "idle"
        return [
            f"rollout phase on {where}: servers {size(self.server_weights)} of weights "
            f"and {kv}; trainer state {size(self.trainer_state)} {host}",
            f"training phase on {where}: trainer {size(self.trainer_state)} "
            "(parameters, gradients, optimizer state; activations on top); servers released",
        ]


def estimate(cfg: ExperimentConfig, mode: AllocationMode, config: dict) -> PhaseMemory:
    """The estimate for a colocated `mode` of the model `config` (its config.json)."""
    assert mode.inference is not None and mode.train is not None
    n = param_count(config)
    backend = mode.inference_backend
    section = getattr(cfg.inference, backend or "embedded")
    server_bytes = DTYPE_BYTES.get(getattr(section, "dtype", "bfloat16"), 2)
    per_server = mode.inference.per_replica_size
    kv, fraction = None, 0.0
    if backend == "embedded":
        e = cfg.inference.embedded
        context = e.context_length or config.get("max_position_embeddings", 2048)
        if not cfg.rollout.agent and cfg.rollout.workflow == "single_turn":
            # one turn: no sequence is longer than a prompt and its reply
            context = min(context, cfg.dataset.max_prompt_len + cfg.gconfig.max_new_tokens)
        rows = min(e.max_running_requests, cfg.rollout.batch_size * cfg.rollout.group_size)
        kv = rows * context * kv_bytes_per_token(config, server_bytes)
    elif backend == "sglang":
        fraction = cfg.inference.sglang.mem_fraction_static
    else:
        fraction = cfg.inference.vllm.gpu_memory_utilization
    # FSDP2 shards over d x c, tensor parallelism splits each shard over t
    trainer = trainer_state_bytes(cfg, config, mode.train.world_size)
    return PhaseMemory(n * server_bytes // per_server, kv, fraction, trainer)

"""All of FSDP2 in one place: build on meta, shard blocks then root, load weights.

`build_sharded_model` is the only entry point the trainer uses:
  1. build the model from its HF config with parameters on the meta device (buffers such
     as rotary frequencies stay real, since no checkpoint holds them);
  2. `parallelize`: `fully_shard` each block chosen by the wrap policy, then the root,
     with an explicit MixedPrecisionPolicy; fail loudly if no block matched;
  3. allocate the local shards and load the weights: every rank reads the safetensors,
     or with `memory_efficient_load` only rank 0 reads and the shards are broadcast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from areal_cli.config.schema import FSDPEngineConfig, torch_dtype


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while buffers are built for real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # A parameter already on meta is being shared (tied embeddings): keep the same object.
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def wrap_classes(model: nn.Module, cfg: FSDPEngineConfig) -> set[str]:
    """Class names to shard one by one: the policy's list, else the model's _no_split_modules."""
    names = cfg.wrap_policy.transformer_layer_cls_to_wrap or list(
        getattr(model, "_no_split_modules", None) or []
    )
    return set(names)


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: FSDPEngineConfig) -> nn.Module:
    """Apply FSDP2 to `model` in place: each wrapped block, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if cfg.offload_params and mesh.device_type == "cpu":
        raise ValueError(
            "actor.fsdp.offload_params needs an accelerator; on CPU the parameters already live in host memory"
        )
    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(cfg.param_dtype), reduce_dtype=torch_dtype(cfg.reduce_dtype)
    )
    kwargs = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    classes = wrap_classes(model, cfg)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise ValueError(
            f"FSDP wrap policy matched no module (looked for {sorted(classes) or 'nothing'}); "
            "set actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap to the model's layer class"
        )
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _load_full_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def build_sharded_model(
    model_dir: Path,
    mesh: DeviceMesh,
    cfg: FSDPEngineConfig,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """An FSDP2-sharded HF causal LM with the weights of `model_dir`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    parallelize(model, mesh, cfg)
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    model.to_empty(device=device)
    for name, value in buffers.items():  # to_empty wiped them; they are not in checkpoints
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = value.to(device)
    rank0_only = cfg.memory_efficient_load
    full = _load_full_state(model_dir) if (not rank0_only or dist.get_rank() == 0) else {}
    if getattr(config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=rank0_only, strict=True)
    set_model_state_dict(model, full, options=options)
    return model

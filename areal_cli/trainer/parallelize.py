"""All of the trainer's parallelism in one place: build on meta, TP, FSDP2, load weights.

`build_sharded_model` is the only entry point the trainer uses:
  1. build the model from its HF config with parameters on the meta device (buffers such
     as rotary frequencies stay real, since no checkpoint holds them);
  2. `parallelize`: with t > 1, tensor parallelism on the mesh's tp dim, by the plan of
     the model's architecture (`TP_PLANS`); then `fully_shard` each block chosen by the
     wrap policy, then the root, over the dp x cp ranks, with an explicit
     MixedPrecisionPolicy; fail loudly if no block matched. A 1-rank trainer (`fsdp:d1`)
     whose compute dtype is its parameters' dtype is left unwrapped (`single_rank`):
     FSDP2 would only add per-block hooks, copies and DTensor dispatch (~20% of the
     demo's step) to a model that nothing shards;
  3. allocate the local shards and load the weights: every rank reads the safetensors,
     or with `memory_efficient_load` only rank 0 reads and the shards are broadcast.

Tensor parallelism (Megatron's layout): q/k/v and gate/up are split by output columns,
o and down by input rows, so each block needs one all-reduce in forward for attention
and one for the MLP. The embedding is split over the vocabulary (its partial outputs are
summed), and so is the LM head, whose logits stay split:
`losses.label_logprobs_and_entropy` reduces over the vocabulary shards without gathering them.
HF's attention reshapes with -1 heads, so each rank runs its local heads unchanged.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_cli.config.model_info import parallel_problem
from areal_cli.config.schema import FSDPEngineConfig, torch_dtype
from areal_cli.models.lora import LoraSpec, is_adapter_key
from areal_cli.trainer.mesh import TrainerMesh

# The plan of every architecture in TP_MODEL_TYPES: all are Llama-shaped (Qwen2 adds q/k/v
# biases, Qwen3 per-head q/k norms; both follow the split).
_TP_LAYER = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


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
    """Class names to shard one by one: the policy's list, else the model's _no_split_modules.
    On our own decoder, transformers' layer class names (`LlamaDecoderLayer`, ... as
    AReaL recipes give them) name its `DecoderLayer`."""
    names = cfg.wrap_policy.transformer_layer_cls_to_wrap or list(
        getattr(model, "_no_split_modules", None) or []
    )
    if _own(model):
        names = ["DecoderLayer" if n.endswith("DecoderLayer") else n for n in names]
    return set(names)


def _own(model: nn.Module) -> bool:
    """Whether `model` is our own decoder (areal_cli.models.decoder), not transformers'."""
    from areal_cli.models.decoder import DecoderBase

    return isinstance(model, DecoderBase)


def apply_tensor_parallel(model: nn.Module, tmesh: TrainerMesh) -> None:
    """Split the model's layers over the tp ranks (Megatron's layout; see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in _TP_LAYER.items()}
    for layer in model.model.layers:
        parallelize_module(layer, tmesh.tensor, plan)
    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    }
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if head is not None:  # a scalar head stays whole: its input is replicated
        # The logits stay split over the vocabulary (see losses.token_logprobs).
        root["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    parallelize_module(model, tmesh.tensor, root)
    if tied:  # both split the same [vocab, hidden] rows: keep one parameter for both
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def single_rank(model: nn.Module, tmesh: TrainerMesh, cfg: FSDPEngineConfig) -> bool:
    """The plain path: one trainer rank in all, no offload, and mixed precision that
    would change nothing (compute in the parameters' own dtype)."""
    params = next(model.parameters(), None)
    dtype = params.dtype if params is not None else torch.float32
    return (
        tmesh.mesh.size() == 1
        and not cfg.offload_params
        and torch_dtype(cfg.param_dtype) == dtype
        and torch_dtype(cfg.reduce_dtype) == dtype
    )


def parallelize(
    model: nn.Module, tmesh: TrainerMesh, cfg: FSDPEngineConfig, compile_layers: bool = False
) -> nn.Module:
    """Apply tensor parallelism (t > 1), then FSDP2 to `model` in place: each wrapped
    block, then the root, over the dp x cp ranks; or nothing but the attention on the
    `single_rank` path. `compile_layers` (actor.compile): between the two, each block of
    our own decoder is compiled (`compile_blocks`)."""
    mesh = tmesh.fsdp
    if cfg.offload_params and mesh.device_type == "cpu":
        raise ValueError(
            "actor.fsdp.offload_params needs an accelerator; on CPU the parameters already live in host memory"
        )
    problem = parallel_problem(model.config.to_dict(), tmesh.tp, tmesh.cp)
    if problem:
        raise ValueError(problem)
    if tmesh.tp > 1:
        if any(is_adapter_key(name) for name, _ in model.named_parameters()):
            raise ValueError(
                "LoRA (actor.use_lora) with tensor parallelism (t > 1) is not built; "
                "use d and c only"
            )
        apply_tensor_parallel(model, tmesh)
    # attention per packed sequence; with cp > 1, over whole sequences through all-to-alls
    if _own(model):
        model.attention = tmesh.attention
    else:
        from areal_cli.trainer.attention import ATTENTION

        tmesh.attention.install()
        model.config._attn_implementation = ATTENTION
    classes = wrap_classes(model, cfg)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise ValueError(
            f"FSDP wrap policy matched no module (looked for {sorted(classes) or 'nothing'}); "
            "set actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap to the model's layer class"
        )
    if compile_layers:
        compile_blocks(model, blocks)
    if single_rank(model, tmesh, cfg):
        return model
    # imported past the single-rank return: FSDP pulls in DTensor, ~1 s of a rank's start
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(cfg.param_dtype), reduce_dtype=torch_dtype(cfg.reduce_dtype)
    )
    kwargs = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def compile_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """torch.compile each block in place (`Module.compile`, shapes dynamic: micro-batches
    differ in length), after tensor parallelism and before FSDP2, as torchtitan does. The
    packed attention stays eager (it plans per micro-batch on the host, and its kernels are
    fused already): the model calls it through `torch.compiler.disable`, so each layer is
    two graphs, around it. Our own decoder only: another model runs as it is, said once."""
    from areal_cli.trainer import collectives

    if not _own(model):
        collectives.note(
            f"actor.compile: {type(model).__name__} is not areal's own decoder "
            "(Llama, Mistral, Qwen2, Qwen3); it runs uncompiled"
        )
        return
    import torch._dynamo

    # every layer is its own module: room for each, plus recompiles as lengths turn dynamic
    torch._dynamo.config.cache_size_limit = max(
        torch._dynamo.config.cache_size_limit, 2 * len(blocks) + 8
    )
    model.attention = torch.compiler.disable(model.attention)
    for block in blocks:
        block.compile(dynamic=True)
    collectives.note(
        f"actor.compile: {len(blocks)} decoder layers go through torch.compile "
        "(the first steps compile them)"
    )


class ScalarHeadModel(nn.Module):
    """A causal LM's body and a linear head giving one score per token (reward models;
    see areal_cli.models.scalar_head). Its parameters are named as in HF's
    *ForSequenceClassification (`model.*`, `score.weight`), so checkpoints go both ways;
    `forward` returns the scores [batch, tokens]."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        from transformers import AutoModel

        super().__init__()
        self.config = config
        self.model = AutoModel.from_config(config, dtype=dtype)
        self.score = nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype)
        self._no_split_modules = getattr(self.model, "_no_split_modules", None)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False
    ) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)
        return self.score(out.last_hidden_state).squeeze(-1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def scalar_model(source: Path, out: Path, seed: int, head_std: float | None = None) -> Path:
    """The scalar-head folder to build a reward model or critic from (collective):
    `source` itself when it already has a head, else OUT, the body of `source` with a new
    head (areal_cli.models.scalar_head), written by rank 0 while the others wait."""
    from areal_cli.models.scalar_head import is_scalar_config, make_scalar_folder
    from areal_cli.trainer import collectives

    if is_scalar_config(json.loads((source / "config.json").read_text())):
        return source
    if collectives.rank() == 0:
        make_scalar_folder(source, out, seed, head_std=head_std)
    collectives.barrier()
    return out


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
    tmesh: TrainerMesh,
    cfg: FSDPEngineConfig,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    compile_layers: bool = False,
    lora: LoraSpec | None = None,
    seed: int = 0,
) -> nn.Module:
    """An FSDP2-sharded causal LM with the weights of `model_dir`: our own decoder for the
    Llama family (areal_cli.models.decoder), transformers' for any other; a scalar-head
    model when `model_dir` is a sequence-classification folder (our `DecoderScorer` for the
    Llama family, else `ScalarHeadModel` on transformers' body). With `lora`,
    the targeted linear layers get adapters (areal_cli.models.lora), fresh from `seed`
    and alike on every rank, and only the adapters train. `compile_layers`: see
    `parallelize`."""
    import torch.distributed as dist

    from areal_cli.models import lora as lora_lib
    from areal_cli.models.decoder import (
        DecoderConfig,
        DecoderLM,
        DecoderScorer,
        allocate,
        unsupported,
    )
    from areal_cli.models.scalar_head import is_scalar_config

    raw = json.loads((model_dir / "config.json").read_text())
    if unsupported(raw) is None:
        own = DecoderScorer if is_scalar_config(raw) else DecoderLM
        model: nn.Module = own.on_meta(DecoderConfig.from_dict(raw), torch_dtype(dtype))
        config: Any = model.config
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with params_on_meta():
            if is_scalar_config(raw):
                model = ScalarHeadModel(config, torch_dtype(dtype))
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
        model.config.use_cache = False
    if lora is not None:
        lora_lib.inject(model, lora)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parallelize(model, tmesh, cfg, compile_layers)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if tmesh.mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    allocate(model, device)  # buffers (no checkpoint holds them) keep their values
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        embedding = model.get_input_embeddings().weight
        if not hasattr(embedding, "to_local"):  # unwrapped: allocate gave each its own tensor
            head.weight = embedding
    rank0_only = cfg.memory_efficient_load
    full = _load_full_state(model_dir) if (not rank0_only or dist.get_rank() == 0) else {}
    if getattr(config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)
    if lora is not None and (not rank0_only or dist.get_rank() == 0):
        full.update(lora_lib.initial_state(model, seed))
    if rank0_only:
        # imported here: ~0.7 s of a rank's start-up, on the way to its first step
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
        set_model_state_dict(model, full, options=options)
    else:
        _copy_local_blocks(model, full)
    return model


@torch.no_grad()
def _copy_local_blocks(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Every rank holds the whole checkpoint: copy each parameter's local block out of it.

    The block of a DTensor is where `compute_local_shape_and_global_offset` says, for
    any layout (FSDP2 rows, tensor-parallel rows or columns, both, uneven): no
    collective, and unlike `set_model_state_dict`, no requirement that FSDP's strided
    shards over tensor-parallel ones divide evenly (a vocabulary of 49155 over t2 x d2)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(full) - {"lm_head.weight"})
    unexpected = sorted(set(full) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, value in state.items():
        if name not in full:
            continue  # lm_head.weight of a tied model: the embedding's block
        source = full[name]
        if tuple(source.shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(source.shape)} != model {tuple(value.shape)}"
            )
        if not hasattr(value, "to_local"):
            value.copy_(source)
            continue
        # here, not above: one unsharded rank never needs DTensor (~0.3 s to import)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        block = source[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        value.to_local().copy_(block)

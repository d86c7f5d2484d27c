"""Our own Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 without transformers.

Why: transformers' modeling code costs each process ~2.3 s of CPU to import (its Llama
pulls torch.distributed.tensor, dynamo and its kernel hub; measured on a 2-core AMD EPYC,
issue 49), and the embedded engine wants a forward it controls end to end (its cache in
place, attention over each row's own keys; issue 44). These four architectures are one
shape, so one module serves them:

  embed -> N x [RMSNorm -> attention (q/k/v, optional biases, optional per-head q/k
  RMSNorm, rotary, grouped KV) -> residual -> RMSNorm -> SwiGLU MLP -> residual]
  -> RMSNorm -> LM head (optionally tied to the embedding)   DecoderLM
              -> score head, Linear(hidden, 1) per token      DecoderScorer (reward models, critics)

The parameters carry transformers' names (`model.layers.0.self_attn.q_proj.weight`, ...),
so checkpoints, weight updates and tensor-parallel plans work on either model, and the
arithmetic follows transformers' op for op (RMSNorm in float32, rotary tables in float32
cast to the activations' dtype), so logits agree with it to float rounding (checked by
tests/unit/test_decoder.py against transformers itself).

`unsupported(config)` says why a config.json is not one of these (another model_type, a
sliding window shorter than the context, a rotary scaling other than default, linear or
llama3, an activation other than SiLU or tanh-GELU); callers then use transformers.

Attention is pluggable: `model.attention` (or `forward(..., attention=f)`) with
transformers' attention signature `f(module, query, key, value, mask, dropout=, scaling=)
-> (out, None)`, query [batch, heads, tokens, head_dim] and out [batch, tokens, heads,
head_dim]. The default `causal_attention` is SDPA, causal when it gets no mask; the
trainer sets its packed, context-parallel one (areal_cli.trainer.attention). A `cache` (the embedded
engine's kv_cache) takes each layer's new keys and values and returns the keys and values
to attend to: `cache.update(key, value, layer_index)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
ROPE_TYPES = ("default", "linear", "llama3")

Attention = Callable[..., tuple[torch.Tensor, Any]]
Device = torch.device | str | None


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters in transformers 5's form (`rope_parameters`), also from the
    older `rope_theta` + `rope_scaling` keys."""
    given = config.get("rope_parameters")
    if isinstance(given, dict) and "rope_theta" in given:
        return dict(given)
    scaling = dict(config.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {"rope_type": kind, "rope_theta": config.get("rope_theta", 10000.0), **scaling}


def _sliding(config: dict[str, Any]) -> bool:
    """Whether some layer attends through a window shorter than the context."""
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        return True
    window = config.get("sliding_window")
    if config.get("model_type") in ("qwen2", "qwen3"):
        return bool(config.get("use_sliding_window")) and window is not None
    return window is not None and window < int(config.get("max_position_embeddings") or 0)


def unsupported(config: dict[str, Any]) -> str | None:
    """Why `config` (a config.json) is not a model this module builds; None when it is."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} is not one of {', '.join(MODEL_TYPES)}"
    if _sliding(config):
        return "it uses sliding-window attention"
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return f"rotary scaling {rope.get('rope_type')!r} is not one of {', '.join(ROPE_TYPES)}"
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return "it applies rotary embeddings to part of each head"
    act = config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} is not one of {', '.join(ACTIVATIONS)}"
    if config.get("pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1 splits its projections"
    return None


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a Llama-family model, from its config.json (transformers' defaults
    where a key is missing)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    rope: dict[str, Any]
    architectures: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DecoderConfig:
        problem = unsupported(config)
        if problem is not None:
            raise ValueError(f"not a Llama-family model this decoder builds: {problem}")
        kind = config["model_type"]
        heads = int(config["num_attention_heads"])
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=kind,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (and none on o); Mistral none
            qkv_bias=True if kind == "qwen2" else attention_bias and kind != "mistral",
            o_bias=attention_bias and kind in ("llama", "qwen3"),
            mlp_bias=bool(config.get("mlp_bias", False)) and kind == "llama",
            qk_norm=kind == "qwen3",
            hidden_act=config.get("hidden_act", "silu"),
            rope=rope_parameters(config),
            architectures=list(config.get("architectures") or []),
            raw=dict(config),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> DecoderConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The config.json it was read from (as transformers' configs offer it)."""
        return dict(self.raw)


def inverse_frequencies(cfg: DecoderConfig) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2], as transformers computes them."""
    dim = cfg.head_dim
    base = float(cfg.rope["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope.get("rope_type", "default")
    if kind == "linear":
        return inv / float(cfg.rope["factor"])
    if kind == "llama3":
        factor = float(cfg.rope["factor"])
        low, high = float(cfg.rope["low_freq_factor"]), float(cfg.rope["high_freq_factor"])
        old = float(cfg.rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin [batch, tokens, head_dim] for position ids, in the activations' dtype."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA over [batch, heads, tokens, head_dim]: causal without a mask, else under the
    mask (True = attend, or additive, broadcast over heads and queries). Grouped key/value
    heads are read in place, never repeated: SDPA's `enable_gqa` for several query
    tokens; for one (a decode step) the query heads of a group become the query length of
    one call on their key/value head (transformers calls it pack_gqa). One CPU thread on
    a 2-core AMD EPYC (Milan, no AVX-512), SmolLM2-135M's heads (9 over 3), batch 128,
    176 cached tokens under a padding mask: folded 5.2 / 5.6 ms, enable_gqa 5.8 / 26.3 ms,
    repeated K and V 89 / 68 ms, in fp32 / bf16."""
    groups = query.shape[1] // key.shape[1]
    if query.shape[2] == 1 and groups > 1:
        rows, heads, _, dim = query.shape
        folded = query.reshape(rows, key.shape[1], groups, dim)
        out = F.scaled_dot_product_attention(
            folded, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
        )  # not causal: the "query length" here is the group's heads of one token
        return out.reshape(rows, heads, 1, dim).transpose(1, 2), None
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=attention_mask is None and query.shape[2] > 1,
        scale=scaling,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2), None


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = cfg.head_dim**-0.5
        q_out, kv_out = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias, device=device)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias, device=device)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias, device=device)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.o_bias, device=device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attention: Attention,
        mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)  # heads from the weights: tp-local
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.unsqueeze(1) for t in rotary)
        q, k, v = (
            _rotate(q.transpose(1, 2), cos, sin),
            _rotate(k.transpose(1, 2), cos, sin),
            v.transpose(1, 2),
        )
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, _ = attention(self, q, k, v, mask, dropout=0.0, scaling=self.scaling)
        return self.o_proj(out.reshape(*x.shape[:-1], -1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: Device = None) -> None:
        super().__init__()
        inner, bias = cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(cfg.hidden_size, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, cfg.hidden_size, bias=bias, device=device)
        self.act_fn = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_idx, device)
        self.mlp = DecoderMLP(cfg, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), (cos, sin), attention, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: Device = None) -> None:
        super().__init__()
        table = torch.empty(cfg.vocab_size, cfg.hidden_size, device=device)
        if table.device.type != "meta":
            nn.init.normal_(table)
        # given its table: on meta, Embedding's own normal_ init imports dynamo (~1.7 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        layers = (DecoderLayer(cfg, i, device) for i in range(cfg.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(cfg)  # a real buffer: no checkpoint holds it


class DecoderOutput(NamedTuple):
    """What forward returns, named as transformers' output (a tuple, so that FSDP2 finds
    the tensor in it for its backward hooks)."""

    logits: torch.Tensor


class DecoderBase(nn.Module):
    """What the causal LM and the scalar-head model share: the body (`model.*`), the
    attention they call, activation checkpointing; each adds its head and forward."""

    _no_split_modules = ["DecoderLayer"]

    def __init__(self, cfg: DecoderConfig, device: Device = None) -> None:
        """`device="meta"`: parameters without memory, to be allocated and loaded later
        (the rotary table is computed for real either way)."""
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, device)
        self.checkpointing = False
        self.attention: Attention = causal_attention  # the trainer sets its packed one

    @classmethod
    def on_meta(cls, cfg: DecoderConfig, dtype: torch.dtype) -> Any:
        """Parameters of `dtype` on the meta device (to be allocated and loaded), the
        rotary table real and in float32, as transformers keeps it."""
        model = cls(cfg, device="meta").to(dtype)
        model.model.rotary_emb.inv_freq = inverse_frequencies(cfg)
        return model

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        *,
        attention: Attention | None = None,
        mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """The final normed hidden states [batch, tokens, hidden]; `attention` defaults to
        the model's own (`self.attention`); position ids default to 0..tokens-1 per row."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        attention = attention or self.attention
        body = self.model
        x = body.embed_tokens(input_ids)
        cos, sin = body.rotary_emb(x, position_ids)
        for layer in body.layers:
            if self.checkpointing and self.training:
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(layer, x, cos, sin, attention, mask, cache, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attention, mask, cache)
        return body.norm(x)

    def gradient_checkpointing_enable(self, **_: Any) -> None:
        """Recompute each layer's activations in backward (transformers' method name)."""
        self.checkpointing = True

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens


class DecoderLM(DecoderBase):
    """A Llama-family causal LM (see the module docstring); parameters named as in
    transformers' *ForCausalLM."""

    def __init__(self, cfg: DecoderConfig, device: Device = None) -> None:
        super().__init__(cfg, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        attention: Attention | None = None,
        mask: torch.Tensor | None = None,
        cache: Any = None,
        last: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> DecoderOutput:
        """`.logits` [batch, tokens, vocab], or with `last` (a position per row) only those
        positions' [batch, vocab]: the head then projects nothing else. Called like a
        transformers model (`model(input_ids=..., position_ids=...).logits`); position ids
        default to 0..tokens-1 per row; `use_cache` is accepted and means nothing (the
        only cache is the one passed in)."""
        x = self.hidden_states(input_ids, position_ids, attention=attention, mask=mask, cache=cache)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last]
        return DecoderOutput(self.lm_head(x))

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


class DecoderScorer(DecoderBase):
    """A Llama-family body with a scalar head (areal_cli.models.scalar_head): `score`,
    Linear(hidden, 1) without bias at every position, for reward models and PPO critics.
    Parameters named as in transformers' *ForSequenceClassification (`model.*`,
    `score.weight`); it has no output embeddings, so nothing ties to the input table."""

    def __init__(self, cfg: DecoderConfig, device: Device = None) -> None:
        super().__init__(cfg, device)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        attention: Attention | None = None,
        mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> torch.Tensor:
        """The head's output at every position, [batch, tokens]; called as the trainer
        calls a scalar model (`model(input_ids=..., position_ids=..., use_cache=False)`);
        `use_cache` means nothing here."""
        x = self.hidden_states(input_ids, position_ids, attention=attention, mask=mask)
        return self.score(x).squeeze(-1)


def allocate(model: nn.Module, device: Device) -> None:
    """Memory on `device` for the model's meta tensors, uninitialised (as
    `model.to_empty`), and its real ones (buffers such as the rotary table, which no
    checkpoint holds) moved there with their values, where to_empty would wipe them.
    Plain tensors are made with torch.empty: empty_like of a meta tensor goes through
    torch's reference implementations, whose first use imports sympy (~0.4 s of a start)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if hasattr(t, "to_local"):  # a DTensor: its local shard, as to_empty makes it
            return torch.empty_like(t, device=device)
        if t.device.type != "meta":
            return t.to(device)
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    model._apply(empty)

"""The trainer's layout as `--dry-run` shows it: the mesh, who holds which block of a
sample layer, and a memory estimate per rank. Arithmetic on config.json's sizes only (no
torch), so a plan for a GPU cluster prints on a laptop.

Ranks follow the trainer's mesh (areal_cli.trainer.mesh): shape (dp, cp, tp), tp
innermost, so rank = (dp_i * cp + cp_j) * tp + tp_k. Tensor parallelism splits a
column-parallel weight's rows (q/k/v, gate/up) or a row-parallel weight's columns (o,
down) in `torch.chunk` pieces; FSDP2 then splits each rank's piece by rows over the
dp x cp ranks.

Memory per rank, in the model's dtype unless said (AdamW keeps two fp32 states):
  parameters, gradients   (tp-split weights / t + replicated norms) / (d x c)
  optimizer               2 x 4 bytes per parameter of the rank's shard (AdamW; SGD: 0)
  gathered block          one decoder layer's weights / t, all-gathered by FSDP2 while
                          it runs
  activations             tokens per micro-batch / c, per layer: 5 hidden + (q + k + v + o
                          outputs) / t + 4 intermediate / t values, in fp32
  logits                  tokens per micro-batch / c x vocab / t, twice (the logits and
                          their gradient) in the compute dtype, plus one chunk's float32
                          temporaries: the logprobs and entropy are taken chunk by chunk
                          (trainer.losses.label_logprobs_and_entropy), never as a float32
                          copy of the whole logits
  attention scores        heads / (t x c) x tokens x min(tokens, longest sequence) fp32 per
                          layer, only where the attention kernel keeps them for backward
                          (no flash kernel). Attention runs per packed sequence
                          (areal_cli.trainer.attention), so a micro-batch's scores are
                          sum(len^2) <= longest x tokens, not tokens^2
  attention (flash)       instead, on GPUs in bf16/fp16, where the trainer's varlen
                          FlashAttention keeps only each query's logsumexp: heads /
                          (t x c) x tokens fp32 per layer (if its probe fails on the
                          machine, the padded SDPA path keeps the scores above)
The estimate shows which terms each layout divides: t divides parameters, gradients and
optimizer states a second time and the per-token activations; c divides the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# trainer.losses.CHUNK_ELEMENTS, without importing torch (tests/unit/test_layout.py checks
# that they agree)
LOGITS_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a Llama-shaped decoder, from its config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> ModelDims:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    def layer_weights(self) -> int:
        """Weights of one decoder layer that tensor parallelism splits."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    def split_and_replicated(self) -> tuple[int, int]:
        """(weights that t splits, weights every tp rank holds whole: the norms)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = self.hidden * (2 * self.layers + 1)
        return self.layers * self.layer_weights() + embeddings, norms


def rank_grid(dp: int, cp: int, tp: int) -> list[str]:
    """One line per dp group: its cp slices and, in each, the tp ranks."""
    lines = []
    for i in range(dp):
        slices = [
            "[" + " ".join(str((i * cp + j) * tp + k) for k in range(tp)) + "]" for j in range(cp)
        ]
        lines.append(f"dp {i}: " + "  ".join(f"cp {j} tp {s}" for j, s in enumerate(slices)))
    return lines


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces of range(n) as (start, stop)."""
    size = -(-n // parts)
    return [(min(k * size, n), min((k + 1) * size, n)) for k in range(parts)]


def sample_layer(dims: ModelDims, dp: int, cp: int, tp: int) -> list[str]:
    """Which rank holds which block of layer 0's q_proj (column-parallel) and o_proj
    (row-parallel) weights."""
    q = dims.heads * dims.head_dim
    lines = []
    for name, shape, split_dim in (
        ("layers.0.self_attn.q_proj.weight", (q, dims.hidden), 0),
        ("layers.0.self_attn.o_proj.weight", (dims.hidden, q), 1),
    ):
        lines.append(f"{name} [{shape[0]}, {shape[1]}]:")
        for k, (t0, t1) in enumerate(_chunks(shape[split_dim], tp)):
            rows = (t0, t1) if split_dim == 0 else (0, shape[0])
            for f, (r0, r1) in enumerate(_chunks(rows[1] - rows[0], dp * cp)):
                rank = f * tp + k  # fsdp index f = dp_i * cp + cp_j
                cols = f"{t0}:{t1}" if split_dim == 1 else f"0:{shape[1]}"
                lines.append(f"  rank {rank}: rows {rows[0] + r0}:{rows[0] + r1}, columns {cols}")
    return lines


def memory_per_rank(
    dims: ModelDims,
    dp: int,
    cp: int,
    tp: int,
    tokens: int,
    dtype: str = "float32",
    optimizer: str = "adamw",
    seq_len: int | None = None,
    compute_dtype: str | None = None,
    gpu: bool = False,
) -> dict[str, float]:
    """Bytes per rank of each term in the module docstring, and their total; the model
    computes in `compute_dtype` (mixed precision's param_dtype; default: `dtype`), on GPUs
    with `gpu` (then in bf16/fp16 attention is FlashAttention's)."""
    size = _BYTES[dtype]
    split, replicated = dims.split_and_replicated()
    shard = (split / tp + replicated) / (dp * cp)
    local_tokens = -(-tokens // cp)
    span = min(tokens, seq_len or tokens)
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    per_token_layer = 5 * dims.hidden + (2 * q + 2 * kv) / tp + 4 * dims.intermediate / tp
    terms = {
        "parameters": shard * size,
        "gradients": shard * size,
        "optimizer": shard * 8 if optimizer == "adamw" else 0.0,
        "gathered block": dims.layer_weights() / tp * size,
        "activations": local_tokens * dims.layers * per_token_layer * 4,
        "logits": local_tokens * dims.vocab / tp * 2 * _BYTES[compute_dtype or dtype]
        + min(local_tokens * dims.vocab / tp, LOGITS_CHUNK_ELEMENTS) * 3 * 4,
    }
    per_query = dims.layers * dims.heads / (tp * cp) * tokens * 4
    if gpu and (compute_dtype or dtype) in ("bfloat16", "float16"):
        terms["attention (flash)"] = per_query
    else:
        terms["attention scores"] = per_query * span
    terms["total"] = sum(terms.values())
    return terms


def describe(
    dims: ModelDims,
    dp: int,
    cp: int,
    tp: int,
    tokens: int,
    dtype: str,
    optimizer: str,
    seq_len: int | None = None,
    compute_dtype: str | None = None,
    gpu: bool = False,
) -> list[str]:
    """The lines --dry-run prints about the trainer's layout (`gpu`: it trains on GPUs)."""
    lines = [f"mesh dp {dp} x cp {cp} x tp {tp} = {dp * cp * tp} ranks:"]
    lines += ["  " + line for line in rank_grid(dp, cp, tp)]
    lines += sample_layer(dims, dp, cp, tp)
    how = (tokens, dtype, optimizer, seq_len, compute_dtype, gpu)
    memory = memory_per_rank(dims, dp, cp, tp, *how)
    base = memory_per_rank(dims, 1, 1, 1, *how)
    lines.append(
        f"memory per rank (estimate; micro-batches of {tokens} tokens; {dtype}, {optimizer}):"
    )
    for term, value in memory.items():
        lines.append(
            f"  {term:17s} {value / 2**20:10.1f} MiB   (one rank alone: {base[term] / 2**20:.1f})"
        )
    return lines

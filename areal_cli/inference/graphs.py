"""Decode steps as CUDA graphs: one captured forward per (rows, width) bucket.

A decode step of our own decoder launches ~35 kernels per layer. On a GPU the host cannot
launch them as fast as the device runs them (issue 44: ~1,200 launches and 10.5 ms of
kernels in 100 ms of wall time at batch 128, SmolLM2-360M on an H200). So the decode
forward is captured once per bucket as a CUDA graph and replayed: one launch per step, as
SGLang and nano-vllm do. Sampling stays outside the graph (sampling.sample_tokens: a few
kernels over [rows, vocab], with each request's own host RNG).

What a graph needs, and how it gets it here:
- Fixed shapes. The batch's rows are padded up to a rows bucket (`row_buckets`), and the
  cache columns attended to up to a width bucket (a power of two from 64, at most the
  allocated columns). A padding row decodes token 0 at position 0 into a free cache row,
  and its logits are dropped; columns past a row's own length are masked, as in the plain
  step.
- Fixed addresses. The inputs are static buffers filled in place (`tokens` and
  `positions`, one host-to-device copy per step); the attention mask and the cache's write
  offsets are computed inside the graph from `positions`. The KV buffers stay put: the
  running batch allocates every row up front and keeps its buffers while it is empty
  (`RunningBatch.hold_buffers`). The weights stay put too: on a GPU a weight update copies
  into them (weight_loader.WeightTable.swap_in). A graph records the buffers' addresses
  and layout, so when the batch replaces them (the columns grow, memory is released and
  resumed, a cleared batch gets new buffers: `RunningBatch.generation`) every graph is
  dropped and captured again at its next use.
- Nothing on the host inside the forward: no `.item()`, no tensor made from a Python list.

`mode="eager"` runs the same static step without capturing it: the CPU rehearsal of this
path, which tests compare with the plain step (tests/inference/test_decode_graphs.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from areal_cli.inference.kv_cache import RunningBatch, slot_offsets

logger = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "cuda", "eager", "off")
MIN_WIDTH = 64  # the narrowest width bucket, in cache columns


def row_buckets(max_rows: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, 8, then every 16 up to
    `max_rows` (and `max_rows` itself). A batch runs in the smallest bucket that holds it,
    so at most 15 padding rows past 16 (SGLang's buckets grow by 8 to 16 the same way)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_rows]
    sizes += list(range(16, max_rows, 16))
    return sorted(set(sizes) | {max_rows})


def width_bucket(needed: int, allocated: int) -> int:
    """The cache columns a step attends over: the power of two from MIN_WIDTH that holds
    `needed`, at most the `allocated` columns (which hold `needed` already)."""
    width = MIN_WIDTH
    while width < needed:
        width *= 2
    return min(width, allocated)


def resolve_mode(mode: str, device: torch.device, own_decoder: bool) -> str:
    """What `mode` means on `device`: "auto" captures graphs on CUDA with our own decoder
    and is "off" elsewhere (on a CPU the padded buckets cost more than the launches they
    save). "cuda" where there is no CUDA, or without our decoder (a transformers model's
    forward is not static), is an error."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"decode graph mode must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "auto":
        return "cuda" if device.type == "cuda" and own_decoder else "off"
    if mode in ("cuda", "eager") and not own_decoder:
        raise ValueError(
            f"decode graphs ({mode}) need a Llama-family model that areal's decoder builds"
        )
    if mode == "cuda" and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    return mode


class StaticCache:
    """The running batch's slot layers as a static step sees them: each layer's new keys
    and values are written at offsets computed from the static `positions` (row r's new
    token goes to column positions[r]), and attention reads the first `rows` rows and
    `width` columns. Built inside the step, so the offsets are part of a captured graph."""

    def __init__(self, batch: RunningBatch, rows: int, width: int, positions: torch.Tensor):
        self.layers = batch.layers
        self.rows, self.width = rows, width
        _, heads, columns, _ = self.layers[0].key_buf.shape
        self.offsets = slot_offsets(positions, heads, columns)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        return layer.write(self.offsets, key, value, self.rows, self.width)


class DecodeGraphs:
    """Static decode steps over one running batch, captured as CUDA graphs (mode "cuda")
    or run as they are (mode "eager"); see the module docstring."""

    def __init__(self, module: torch.nn.Module, batch: RunningBatch, max_rows: int, mode: str):
        if mode not in ("cuda", "eager"):
            raise ValueError(f"DecodeGraphs runs mode cuda or eager, not {mode!r}")
        self.module, self.batch, self.mode = module, batch, mode
        self.buckets = row_buckets(max_rows)
        self.max_rows = self.buckets[-1]
        device = next(module.parameters()).device
        # rows 0 and 1: each row's last token and its position (= its cached tokens)
        self.inputs = torch.zeros(2, self.max_rows, 1, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self.staging = torch.zeros(2, self.max_rows, 1, dtype=torch.long, pin_memory=pin)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self._generation = -1  # of the running batch's buffers the graphs were captured on
        self.captures = 0  # graphs captured since the engine started (a figure for benches)
        batch.hold_buffers = True

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def describe(self) -> str:
        kind = "CUDA graphs" if self.mode == "cuda" else "static steps run eagerly"
        return f"{kind}, row buckets {self.buckets[0]}..{self.max_rows} ({len(self.buckets)})"

    def reset(self) -> None:
        """Drop every graph and its memory pool (the KV buffers or weights moved)."""
        self._graphs.clear()
        self._pool = None
        self._generation = -1

    @torch.inference_mode()
    def step(self, seqs: list[Any]) -> torch.Tensor:
        """Float logits [len(seqs), vocab] of one decode step of the running batch (its
        rows are `seqs`, in order)."""
        batch, n = self.batch, len(seqs)
        rows = next(b for b in self.buckets if b >= n)
        lens = [s.kv_len for s in seqs]
        batch.past = max(lens)
        batch.reserve(rows, batch.past + 1)
        width = width_bucket(batch.past + 1, batch.layers[0].key_buf.shape[2])
        stage = self.staging
        stage[0, :n, 0] = torch.tensor([s.output_ids[-1] for s in seqs])
        stage[1, :n, 0] = torch.tensor(lens)
        stage[:, n:rows] = 0  # padding rows: token 0 at position 0, in a free cache row
        # The whole (contiguous) buffer: a slice of it would be copied through a pageable
        # temporary, synchronously; the rows past `rows` are not read by this bucket. The
        # copy is asynchronous: `stage` is written again only at the next step, after this
        # step's sampling has copied its ids back (which waits for the stream).
        self.inputs.copy_(stage, non_blocking=True)
        if self.mode == "eager":
            return self._forward(rows, width)[:n]
        if batch.generation != self._generation:  # the graphs read replaced buffers
            self.reset()
            self._generation = batch.generation
        entry = self._graphs.get((rows, width))
        if entry is None:
            entry = self._graphs[(rows, width)] = self._capture(rows, width)
        graph, out = entry
        graph.replay()
        return out[:n]

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        """The static step: float logits [rows, vocab] from the static inputs."""
        tokens, positions = self.inputs[0, :rows], self.inputs[1, :rows]
        columns = torch.arange(width, device=positions.device)
        mask = (columns[None, :] <= positions)[:, None, None, :]
        cache = StaticCache(self.batch, rows, width, positions)
        out = self.module(tokens, positions, mask=mask, cache=cache)
        return out.logits[:, -1].float()

    def _capture(self, rows: int, width: int) -> tuple[Any, torch.Tensor]:
        """Capture the static step for (rows, width) into a graph sharing one memory pool
        with the others (they never run at once). Two runs on a side stream first, as
        torch asks, so that lazy initialisation (cuBLAS workspaces, SDPA's choice) happens
        outside the capture; they rewrite the same keys and values the replay writes."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(rows, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may touch CUDA meanwhile (stats)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(rows, width)
        if self._pool is None:
            self._pool = graph.pool()
        self.captures += 1
        logger.debug("captured the decode step for %d rows x %d columns", rows, width)
        return graph, out

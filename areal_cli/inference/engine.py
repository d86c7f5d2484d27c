"""A continuous-batching inference engine over any Hugging Face causal-LM folder.

One scheduler thread owns the model. Each loop iteration it runs queued control commands
(abort, pause, weight swap, ...), prefills the newly admitted requests together in one
right-padded forward pass, copies their KV into the running batch, runs one batched decode
step and drops finished rows. Requests therefore join and leave the batch at decode-step
boundaries, and a long request never holds back a short one. When more requests wait
than there are free rows, the default "lof" policy (longest output first, as SGLang
names it) admits those with the most tokens left to generate first (requests queued over
`max_queue_wait_s` go first), which keeps the batch full to the end; a joining group is
prefilled in as few passes as pay off against the right padding between its short and
long contexts.

Its parts live beside this scheduler loop: the request and response types with SGLang's
field names (api.py), sequence state and sampling with its logprob convention
(sampling.py), the running batch's KV cache (kv_cache.py), and weight loading with
read-ahead (weight_loader.py).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch.profiler import record_function

from areal_cli.config.schema import DTYPES, torch_dtype
from areal_cli.inference.api import (
    EngineStats,
    GenerateOutput,
    GenerateRequest,
    WeightUpdate,
)
from areal_cli.inference.graphs import DecodeGraphs, resolve_mode
from areal_cli.inference.memory import GRAPH_TAG, MemoryBusy, parse_tags, trim_host_memory
from areal_cli.inference.model import EngineModel
from areal_cli.inference.sampling import SeqState, sample_tokens
from areal_cli.inference.threads import own_cores
from areal_cli.inference.weight_loader import WeightLoader, WeightLoadError

logger = logging.getLogger(__name__)

T = TypeVar("T")
PauseMode = Literal["abort", "in_place", "retract"]
SchedulePolicy = Literal["fcfs", "lof"]


# A prefill pass costs about this many (padded) prompt tokens on top of its tokens: on CPU
# one pass reads all the weights once, which is worth ~25-50 tokens of compute for 1M-25M
# parameter models.
PREFILL_PASS_COST_TOKENS = 48


def split_by_length(seqs: list[SeqState], pass_cost: int) -> list[list[SeqState]]:
    """Split a prefill group into passes of similar context length, minimising the padded
    tokens plus `pass_cost` per pass (right padding to the longest context in a pass is
    wasted compute). Exact DP over the length-sorted group."""
    if len(seqs) <= 1:
        return [seqs] if seqs else []
    order = sorted(seqs, key=lambda s: s.kv_len)
    sizes = [s.kv_len + 1 for s in order]
    n = len(order)
    best = [0] + [0] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        # the last pass is order[i:j], padded to sizes[j - 1]
        best[j], cut[j] = min((best[i] + pass_cost + (j - i) * sizes[j - 1], i) for i in range(j))
    parts, j = [], n
    while j > 0:
        parts.append(order[cut[j] : j])
        j = cut[j]
    return parts[::-1]


# --------------------------------------------------------------------------- engine


def adapter_base(path: Path) -> Path:
    """The model folder to build the engine from: `path` itself, or for a LoRA adapter
    folder the base model its adapter_config.json names (a local folder)."""
    from areal_cli.rundir.layout import adapter_base_model, is_adapter_folder

    if not is_adapter_folder(path):
        return path
    try:
        return adapter_base_model(path)
    except ValueError as exc:
        raise ValueError(f"{exc}; serve the base model and load the adapter into it") from None


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _shutdown_if_alive(ref: weakref.ref[InferenceEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


class InferenceEngine:
    """Continuous-batching generation with hot weight reload; see the module docstring.

    Thread-safe: `submit`/`generate` and the control methods may be called from any thread.
    Control methods block until the scheduler has applied them (at most one decode step).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "auto",
        max_running_requests: int = 32,
        weight_version: str = "default",
        random_seed: int = 0,
        max_prefill_tokens: int = 8192,
        context_length: int | None = None,
        schedule_policy: SchedulePolicy = "lof",
        max_queue_wait_s: float = 10.0,
        decode_graphs: str = "auto",
        cuda_graph_max_bs: int | None = None,
    ) -> None:
        """`decode_graphs` (inference.graphs): "auto" captures each decode step's forward
        as a CUDA graph on a GPU with areal's own decoder and is "off" elsewhere; "eager"
        runs the same static steps uncaptured (the CPU rehearsal of that path).
        `cuda_graph_max_bs` (SGLang's flag): the largest batch a graph is made for (default
        max_running_requests); larger batches decode without one."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if cuda_graph_max_bs is not None and cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be at least 1, got {cuda_graph_max_bs}")
        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if schedule_policy not in ("fcfs", "lof"):
            raise ValueError(f"unknown schedule_policy {schedule_policy!r}")
        self.schedule_policy = schedule_policy
        self.max_queue_wait_s = max_queue_wait_s
        self.model_path = str(model_path)
        # a LoRA adapter folder is served on its base model, merged in (weight_loader)
        self.base_path = adapter_base(Path(model_path))
        self.device = resolve_device(device)
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        from areal_cli.data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(str(self.base_path))
        self._weight_version = weight_version
        self._seed_rng = random.Random(random_seed)
        self.graph_problem: str | None = None  # why graphs were turned off, if they were
        self._paused = False
        self._released: set[str] = set()  # memory tags given back (inference.memory)
        self._stopping = False
        self._cv = threading.Condition()
        self._waiting: deque[SeqState] = deque()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._inflight: dict[str, SeqState] = {}
        # The model is built, and every step runs, on the scheduler thread: the only
        # thread of the engine that runs torch's parallel CPU kernels (inference.threads).
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        setup = functools.partial(
            self._setup, dtype, context_length, decode_graphs, cuda_graph_max_bs
        )
        self._thread = threading.Thread(
            target=self._run, args=(ready, torch.get_num_threads(), setup),
            name="areal-engine", daemon=True,
        )  # fmt: skip
        self._thread.start()
        ready.result()  # what building the model raised is raised here
        # A scheduler thread still inside torch at interpreter exit aborts the process.
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    def _setup(
        self,
        dtype: str,
        context_length: int | None,
        decode_graphs: str,
        cuda_graph_max_bs: int | None,
    ) -> None:
        """Build the model, read its weights and size the running batch (on the
        scheduler thread)."""
        self._model = EngineModel(str(self.base_path), torch_dtype(dtype), self.device)
        self.model = self._model.module
        self.config = self._model.config
        self.vocab_size = self._model.vocab_size
        self.context_length = context_length or int(
            getattr(self.config, "max_position_embeddings", 0) or 2048
        )
        self.eos_token_ids = self._eos_ids()
        self._loader = WeightLoader(self.model, self.device, self.base_path)
        adapter = self.base_path != Path(self.model_path)
        if self._model.own or adapter:  # allocated, or an adapter: read the weights now
            tensors, identity, _ = self._loader.load(Path(self.model_path))
            self._loader.swap_in(tensors, identity)
        else:  # transformers read them: prepare what it read (CPU bf16/fp16)
            self._loader.packed.refresh()
        self._batch = self._model.running_batch(self.max_running_requests)
        self._graphs: DecodeGraphs | None = None
        mode = resolve_mode(decode_graphs, self.device, self._model.own)
        if mode != "off":
            most = min(cuda_graph_max_bs or self.max_running_requests, self.max_running_requests)
            self._graphs = DecodeGraphs(self.model, self._batch, most, mode)
        logger.info("decode: %s; %s", self.decode_graphs_info, self._loader.packed.describe())

    # ------------------------------------------------------------------ setup helpers

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for value in (self._model.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value is not None:
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # ------------------------------------------------------------------ properties

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def is_paused(self) -> bool:
        return self._paused

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------------ generation API

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future[GenerateOutput]:
        """Queue a request; the future resolves when it finishes or is aborted."""
        seq = SeqState.from_request(
            request, self.tokenizer, self.vocab_size, self.context_length, self._seed_rng
        )
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            if seq.rid in self._inflight:
                raise ValueError(f"a request with rid {seq.rid!r} is already running")
            self._inflight[seq.rid] = seq
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq.future

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Await one request; cancelling the awaiting task aborts the request."""
        future = self.submit(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller went away (e.g. an HTTP client disconnected): free the batch slot.
            with contextlib.suppress(RuntimeError):
                self._post(lambda: self._abort_where(lambda s: s.future is future, "cancelled"))
            raise

    def generate_sync(
        self, request: GenerateRequest, timeout: float | None = None
    ) -> GenerateOutput:
        """Blocking helper for scripts and tests."""
        return self.submit(request).result(timeout)

    # ------------------------------------------------------------------ control API

    def abort(self, rid: str) -> bool:
        """Abort one request (running or queued); False if it is unknown or finished."""
        return self._call(lambda: self._abort_where(lambda s: s.rid == rid, "aborted")) > 0

    def abort_all(self) -> int:
        """Abort every request; return how many were aborted."""
        return self._call(lambda: self._abort_where(lambda s: True, "aborted (abort_all)"))

    def pause(self, mode: PauseMode = "abort") -> int:
        """Stop generating. "abort" ends all in-flight requests with partial output;
        "in_place" keeps their state and KV cache; "retract" requeues them (their cache
        is recomputed on continue). Returns the number of requests affected."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"unknown pause mode {mode!r}")
        return self._call(lambda: self._do_pause(mode))

    def continue_generation(self) -> None:
        """Resume after `pause`."""
        self._call(self._do_continue)

    def release_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Give back the memory of `tags` ("weights", "kv_cache"; None: both) until
        `resume_memory_occupation` (inference.memory); requests wait meanwhile. Raises
        MemoryBusy while a request runs (pause_generation with abort first, as SGLang
        asks), ValueError for an unknown tag."""
        chosen = parse_tags(tags)
        return self._call(lambda: self._do_release(chosen))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Take back the memory `release_memory_occupation` gave (None: every tag)."""
        chosen = parse_tags(tags)
        return self._call(lambda: self._do_resume(chosen))

    @property
    def released(self) -> frozenset[str]:
        """The memory tags given back now."""
        return frozenset(self._released)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Relabel the running weights without loading anything."""
        self._call(lambda: self._set_version(new_version, abort_all_requests))

    def flush_cache(self) -> bool:
        """There is no prefix cache to flush; kept for SGLang API parity."""
        return True

    def stats(self, timeout: float = 30.0) -> EngineStats:
        """A consistent snapshot taken on the scheduler thread."""
        return self._call(self._snapshot, timeout)

    def submit_weight_update(
        self,
        model_path: str | Path,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> concurrent.futures.Future[WeightUpdate]:
        """Queue a weight update; the future gives its outcome.

        The scheduler thread reads and validates `model_path` at the next decode-step
        boundary and swaps it in atomically (decoding waits meanwhile, as in SGLang). On
        any problem the outcome has ok=False with the reason, and the old weights keep
        serving. In-flight requests keep their KV cache and continue on the new weights;
        their `weight_versions` spans show where the switch happened. Doing it all on the
        scheduler thread takes one thread handoff instead of three, which is most of the
        cost of reloading a small model."""
        path, abort = Path(model_path), abort_all_requests
        return self._post(lambda: self._load_and_swap(path, weight_version, abort))

    def submit_received_weights(
        self,
        tensors: dict[str, torch.Tensor],
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> concurrent.futures.Future[WeightUpdate]:
        """Queue a swap of a whole version received over the weight-update group
        (areal_cli.inference.weight_receiver), with `submit_weight_update`'s semantics:
        checked against the model, swapped in at the next decode-step boundary, the old
        weights kept on any problem."""
        abort = abort_all_requests
        return self._post(lambda: self._swap_received(tensors, weight_version, abort))

    def weights_crc32(self, timeout: float = 300.0) -> tuple[int, str]:
        """The CRC-32 of the weights in use as the safetensors file an export of them
        makes (the checksum a handoff manifest records), and their version; taken on the
        scheduler thread, so no swap lands halfway."""
        return self._call(self._weights_crc32, timeout)

    def read_ahead(self, model_path: str | Path) -> bool:
        """Read and validate `model_path` now, on the calling thread, while decoding goes
        on; a later update from the same, unchanged files then only swaps them in. On the
        CPU only. Returns whether the weights are ready; a folder that cannot be loaded is
        left for the update request to refuse with the reason."""
        return self._loader.read_ahead(Path(model_path))

    @property
    def read_ahead_folder(self) -> Path | None:
        """The folder whose weights are read ahead and waiting for their update, if any."""
        return self._loader.ahead_folder

    def watch_for_weights(
        self, directory: str | Path, prefix: str = "v", poll_s: float = 0.5
    ) -> None:
        """Read ahead every handoff entry renamed into `directory` (e.g. RUN/weights) from
        now on, on a background thread: the controller's `/update_weights_from_disk` for it
        then costs a swap, not a read. inotify wakes the thread at once; `poll_s` is the
        fallback where renames are not reported (another node's NFS writes)."""
        if self.device.type != "cpu":
            logger.info("weights read-ahead is off on %s", self.device)
            return
        self._loader.watch(Path(directory), prefix, poll_s, lambda: self._stopping)

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> WeightUpdate:
        """`submit_weight_update`, waiting for the outcome."""
        future = self.submit_weight_update(
            model_path, weight_version, abort_all_requests=abort_all_requests
        )
        return future.result(300.0)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the scheduler; unfinished requests end with an abort finish reason."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ command plumbing

    def _post(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            self._commands.append((fn, future))
            self._cv.notify_all()
        return future

    def _call(self, fn: Callable[[], T], timeout: float | None = 300.0) -> T:
        return self._post(fn).result(timeout)

    # ------------------------------------------------------------------ scheduler thread

    def _run(
        self,
        ready: concurrent.futures.Future[None],
        threads: int,
        setup: Callable[[], None],
    ) -> None:
        """The scheduler thread: take `threads` cores for torch's kernels (those of the
        thread that built the engine), build the model, then serve."""
        own_cores(threads)
        try:
            setup()
        except BaseException as exc:  # raised by the constructor
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, future in commands:
                self._run_command(fn, future)
            if commands:
                # Let the threads waiting for these results run now: on a busy core the
                # OS would otherwise leave them queued behind the next steps (~2 ms).
                os.sched_yield()
            if not (self._paused or self._released):
                self._step()
        self._shutdown_cleanup()

    def _step(self) -> None:
        """Admit, then decode once; an unexpected error fails the batch, not the thread."""
        if self._loader.empty and not self._refill_weights():
            return
        try:
            with record_function("admit"):  # named spans in scripts/profile_inference.py
                self._admit()
            with record_function("decode"):
                self._decode()
        except Exception as exc:
            logger.exception("scheduler step failed; failing %d requests", len(self._batch.seqs))
            for seq in self._batch.seqs:
                self._fail(seq, exc)
            self._batch.clear()

    def _has_work(self) -> bool:
        runnable = not (self._paused or self._released) and (self._waiting or self._batch.seqs)
        return bool(self._stopping or self._commands or runnable)

    @staticmethod
    def _run_command(fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        try:
            future.set_result(fn())
        except Exception as exc:  # handed back to the caller
            future.set_exception(exc)

    def _shutdown_cleanup(self) -> None:
        self._abort_where(lambda s: True, "engine shut down")
        with self._cv:
            commands = list(self._commands)
            self._commands.clear()
        for _, future in commands:
            future.set_exception(RuntimeError("engine is shut down"))

    def _admit(self) -> None:
        """Prefill queued requests together (up to the batch cap and the padded token
        budget) and merge the survivors into the running batch."""
        group: list[SeqState] = []
        width = 0
        room = self.max_running_requests - len(self._batch.seqs)
        with self._cv:
            if self.schedule_policy == "lof" and len(self._waiting) > room > 0:
                self._reorder_waiting()
            while self._waiting and len(group) < room:
                size = self._waiting[0].kv_len + 1
                padded = (len(group) + 1) * max(width, size)
                if group and padded > self.max_prefill_tokens:
                    break
                group.append(self._waiting.popleft())
                width = max(width, size)
        for part in split_by_length(group, PREFILL_PASS_COST_TOKENS):
            self._prefill(part)

    def _reorder_waiting(self) -> None:
        """Longest-first: when more requests wait than there are free rows, admit those
        with the most tokens left to generate first, so that the batch stays full to the
        end instead of trailing off with a few long requests (fewer decode steps for the
        same tokens). A request that has waited `max_queue_wait_s` goes first, in arrival
        order, so short requests are never starved. Caller holds `_cv`."""
        now = time.monotonic()

        def key(seq: SeqState) -> tuple[bool, float]:
            if now - seq.created >= self.max_queue_wait_s:
                return (False, seq.created)
            return (True, -(seq.params.max_new_tokens - len(seq.output_ids)))

        self._waiting = deque(sorted(self._waiting, key=key))

    def _prefill(self, seqs: list[SeqState]) -> None:
        """Prefill right-padded contexts in one forward pass and sample each next token."""
        contexts = [s.prompt_ids + s.output_ids for s in seqs]
        lens = torch.tensor([len(c) for c in contexts], device=self.device)
        width = int(lens.max())
        ids = [c + [0] * (width - len(c)) for c in contexts]  # 0: any valid id, masked out
        columns = torch.arange(width, device=self.device)
        cache = self._model.prefill_cache()
        try:
            logits = self._model.forward(
                torch.tensor(ids, device=self.device),
                columns[None, :].expand(len(seqs), -1),
                (columns[None, :] < lens[:, None]).long(),
                cache,
                last=lens - 1,
            )
        except Exception as exc:
            logger.exception("prefill failed for %d request(s)", len(seqs))
            for seq in seqs:
                self._fail(seq, exc)
            return
        alive = self._advance(seqs, logits)
        index = [i for i, a in enumerate(alive) if a]
        if index:
            self._batch.merge([seqs[i] for i in index], cache, index)

    def _decode(self) -> None:
        """One batched decode step over the running batch."""
        batch = self._batch
        if not batch.seqs:
            return
        logits = self._graph_step() if self._graphs is not None else None
        if logits is None:
            inputs = batch.decode_inputs(self.device, self._model.sdpa)
            logits = self._model.forward(
                inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"], batch.cache
            )  # float32, on the model's device: sampling runs there (sampling.sample_tokens)
        batch.keep(self._advance(batch.seqs, logits))

    def _graph_step(self) -> torch.Tensor | None:
        """The decode step's logits from a static step (a CUDA graph's replay), or None
        when the batch is past the largest graph. A graph that cannot be captured turns
        graphs off for this engine, said once in the log and in `decode_graphs_info`."""
        graphs = self._graphs
        if not graphs.fits(len(self._batch.seqs)):
            return None
        try:
            return graphs.step(self._batch.seqs)
        except Exception as exc:
            if graphs.mode != "cuda":
                raise
            self.graph_problem = f"{type(exc).__name__}: {exc}"
            logger.error("decode graphs are off for this server: %s", self.graph_problem)
            if self.device.type == "cuda":
                # a capture that raised may leave this thread on its side stream; later work
                # (weight copies after the receiver's wait) must run on the default one
                torch.cuda.set_stream(torch.cuda.default_stream(self.device))
            graphs.reset()
            self._graphs = None
            self._batch.hold_buffers = False
            return None

    @property
    def graph_captures(self) -> int:
        """Decode graphs captured since the engine started (0 without graphs)."""
        return self._graphs.captures if self._graphs is not None else 0

    @property
    def decode_graphs_info(self) -> str:
        """How decode steps run: plain, static steps, or CUDA graphs (and how many)."""
        if self._graphs is None:
            why = f" (graphs turned off: {self.graph_problem})" if self.graph_problem else ""
            return "plain steps" + why
        captured = f"; {self._graphs.captures} captured" if self._graphs.mode == "cuda" else ""
        return self._graphs.describe() + captured

    def _advance(self, seqs: list[SeqState], logits: torch.Tensor) -> list[bool]:
        """Sample one token per sequence, finish those that stop; True = still running."""
        alive = []
        for seq, (token, logprob) in zip(seqs, sample_tokens(logits, seqs), strict=True):
            seq.record(token, logprob, self._weight_version)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._complete(seq, reason)
            alive.append(reason is None)
        return alive

    def _finish_reason(self, seq: SeqState, token: int) -> dict[str, Any] | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return {"type": "stop", "matched": token}
        if len(seq.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": len(seq.output_ids)}
        if seq.kv_len + 1 >= self.context_length:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    # ------------------------------------------------------------------ finishing

    def _complete(self, seq: SeqState, reason: dict[str, Any]) -> None:
        with self._cv:
            self._inflight.pop(seq.rid, None)
        version = seq.spans[-1]["version"] if seq.spans else self._weight_version
        seq.future.set_result(
            GenerateOutput(
                rid=seq.rid,
                prompt_ids=seq.prompt_ids,
                output_ids=list(seq.output_ids),
                output_logprobs=list(seq.logprobs),
                text=self.tokenizer.decode(
                    seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
                ),
                finish_reason=reason,
                weight_version=version,
                weight_versions=[dict(s) for s in seq.spans],
                e2e_latency=time.monotonic() - seq.created,
            )
        )

    def _fail(self, seq: SeqState, exc: BaseException) -> None:
        with self._cv:
            self._inflight.pop(seq.rid, None)
        if not seq.future.done():  # it may have finished earlier in the failing step
            seq.future.set_exception(exc)

    def _abort_where(self, pred: Callable[[SeqState], bool], message: str) -> int:
        """Abort matching running and queued requests with their partial output."""
        with self._cv:
            queued = [s for s in self._waiting if pred(s)]
            self._waiting = deque(s for s in self._waiting if not pred(s))
        running = [pred(s) for s in self._batch.seqs]
        aborted = queued + [s for s, hit in zip(self._batch.seqs, running, strict=True) if hit]
        self._batch.keep([not hit for hit in running])
        for seq in aborted:
            self._complete(seq, {"type": "abort", "message": message})
        return len(aborted)

    # ------------------------------------------------------------------ commands

    def _do_pause(self, mode: PauseMode) -> int:
        self._paused = True
        if mode == "abort":
            return self._abort_where(lambda s: True, "aborted by pause_generation")
        if mode == "retract":
            retracted = list(self._batch.seqs)
            self._batch.clear()
            with self._cv:
                self._waiting.extendleft(reversed(retracted))
            return len(retracted)
        return len(self._batch.seqs)

    def _do_release(self, tags: frozenset[str]) -> str:
        if self._batch.seqs:
            raise MemoryBusy(
                f"{len(self._batch.seqs)} request(s) are running; release memory on an idle "
                "server (pause_generation with mode abort first)"
            )
        self._batch.clear()  # its KV buffers (held for decode graphs, else gone already)
        if self._graphs is not None:  # they recorded the buffers' and weights' addresses
            self._graphs.reset()
        tags = tags - {GRAPH_TAG}  # dropped above; captured again at their next use
        if "weights" in tags and "weights" not in self._released:
            with self._loader.lock:
                self._loader.release()
        self._released |= tags
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_host_memory()
        return f"released {sorted(tags)}"

    def _do_resume(self, tags: frozenset[str]) -> str:
        tags = tags - {GRAPH_TAG}
        if "weights" in tags and "weights" in self._released:
            with self._loader.lock:
                self._loader.restore()
        self._released -= tags
        return f"resumed {sorted(tags)}" + (
            "; the weights are read at the next update" if self._loader.empty else ""
        )

    def _refill_weights(self) -> bool:
        """Dropped weights (released on a CPU) and a request to serve before any update:
        read them again from the folder last loaded. If that fails the waiting requests
        fail with the reason (there is nothing to serve them with); returns whether the
        weights are back."""
        update = self._load_and_swap(Path(self.model_path), None, False)
        if update.ok:
            return True
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
        for seq in waiting:
            self._fail(seq, RuntimeError(update.message))
        return False

    def _do_continue(self) -> None:
        self._paused = False

    def _set_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self._abort_where(lambda s: True, "aborted by update_weight_version")
        self._weight_version = version

    def _load_and_swap(
        self, path: Path, weight_version: str | None, abort_all: bool
    ) -> WeightUpdate:
        """Scheduler thread: read (or take what was read ahead), validate, swap in."""
        old = self._weight_version
        with self._loader.lock:
            try:
                tensors, identity, ahead = self._loader.load(path)
            except WeightLoadError as exc:
                message = f"refused weights from {path}: {exc}; still serving {old!r}"
                logger.warning(message)
                return WeightUpdate(False, message, self._snapshot())
            if abort_all:
                self._abort_where(lambda s: True, "aborted by update_weights_from_disk")
            self._loader.swap_in(tensors, identity)
        version = old if weight_version is None else str(weight_version)
        self._weight_version = version
        self.model_path = str(path)
        how = "read ahead" if ahead else "read now"
        logger.info("weights swapped to %s (version %s, %s)", path, version, how)
        message = f"loaded weights from {path} ({how}); weight version {old!r} -> {version!r}"
        return WeightUpdate(True, message, self._snapshot())

    def _swap_received(
        self, tensors: dict[str, torch.Tensor], weight_version: str | None, abort_all: bool
    ) -> WeightUpdate:
        """Scheduler thread: check and swap in a received version."""
        old = self._weight_version
        with self._loader.lock:
            try:
                self._loader.swap_in_received(tensors)
            except WeightLoadError as exc:
                message = f"refused the received weights: {exc}; still serving {old!r}"
                logger.warning(message)
                return WeightUpdate(False, message, self._snapshot())
            if abort_all:
                self._abort_where(lambda s: True, "aborted by update_weights_from_distributed")
        version = old if weight_version is None else str(weight_version)
        self._weight_version = version
        logger.info("weights swapped to the received version %s", version)
        message = f"received {len(tensors)} tensors; weight version {old!r} -> {version!r}"
        return WeightUpdate(True, message, self._snapshot())

    def _weights_crc32(self) -> tuple[int, str]:
        from areal_cli.rundir.safetensors_io import safetensors_crc32

        if self._loader.empty or "weights" in self._released:
            raise MemoryBusy("the weights are released (resume_memory_occupation first)")

        tied = getattr(self.config, "tie_word_embeddings", False)
        items = [
            (name, tensor)
            for name, tensor in self.model.state_dict().items()
            if not (tied and name == "lm_head.weight")  # as an export leaves it out
        ]
        return safetensors_crc32(items), self._weight_version

    def _snapshot(self) -> EngineStats:
        with self._cv:
            waiting = list(self._waiting)
        return EngineStats(
            weight_version=self._weight_version,
            model_path=self.model_path,
            paused=self._paused,
            num_running=len(self._batch.seqs),
            num_waiting=len(waiting),
            progress={s.rid: len(s.output_ids) for s in [*self._batch.seqs, *waiting]},
            kv_cache_bytes=self._batch.nbytes,
        )

"""Reward functions and the process pool that runs them with a per-call timeout.

A reward is ``fn(completion: str, answer: str, **sample_fields) -> float``. Recipes name one as
``builtin:NAME`` (``exact_match``, ``numeric``, ``math``) or ``module:function``, where the module is
a ``.py`` file beside the recipe or an importable module. ``model:PATH`` names a trained reward
model instead (areal_cli.rollout.reward_model), which scores the token ids of prompt and
completion; the pool batches its calls: those that arrive within a few milliseconds of each
other (up to ``BATCH_MAX``) go to a worker as one request, and ``timeout_s`` bounds that request.

:class:`RewardPool` runs rewards in separate worker processes. A call that raises scores 0.0 and is
counted in ``n_errors``; a call that outruns ``timeout_s`` scores 0.0, is counted in ``n_timeouts``,
and its worker is killed and replaced, so a hung reward never blocks later calls.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import math as _math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.config.recipe_code import RecipeCodeError, load_function
from areal_cli.rundir.process import die_with, spawner_pid

if TYPE_CHECKING:
    from areal_cli.config.schema import RewardConfig

RewardFn = Callable[..., float]
BATCH_MAX = 64  # sequences per request to a model reward's worker
BATCH_WAIT_S = 0.005  # how long the first call of a batch waits for others to join

# The last number of a text: optional sign (not after a word char or ")", so "10-2" is 2),
# thousands groups like 1,234 (exactly three digits per group), decimals and an exponent.
_NUMBER = re.compile(
    r"(?:(?<![\w)])-)?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|(?<!\d)\.\d+)"
    r"(?:[eE][-+]?\d+)?"
)
_NUMERIC_TOLERANCE = 1e-6


# ---------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------


def _normalize(text: str) -> str:
    """Strip and collapse runs of whitespace to one space."""
    return " ".join(text.split())


def final_answer(text: str) -> str:
    """The part after the last ``####`` (GSM8K's answer marker), or the whole text."""
    _, sep, tail = text.rpartition("####")
    return tail.strip() if sep else text


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234``, ``-3.5``, ``2e3``), or None."""
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


def exact_match(completion: str, answer: str, **sample_fields: Any) -> float:
    """1.0 when completion and answer are equal after whitespace normalisation, else 0.0."""
    return 1.0 if _normalize(completion) == _normalize(str(answer)) else 0.0


def numeric(completion: str, answer: str, **sample_fields: Any) -> float:
    """1.0 when the completion's last number equals the answer's number within 1e-6."""
    gold = last_number(final_answer(str(answer)))
    if gold is None:
        # A reference without a number is a data problem; raising makes it show up in n_errors.
        raise ValueError(f"reference answer has no number: {answer!r}")
    pred = last_number(completion)
    if pred is None:
        return 0.0
    # rel_tol only matters for numbers so large that 1e-6 is below float resolution.
    return 1.0 if _math.isclose(pred, gold, rel_tol=1e-9, abs_tol=_NUMERIC_TOLERANCE) else 0.0


def math_answer(completion: str, answer: str, **sample_fields: Any) -> float:
    """``builtin:math``: math-verify equivalence of the completion and the reference answer.

    Handles ``\\boxed{}`` and LaTeX in completions, and GSM8K references (``... #### 72``).
    """
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere
    # rely on the caller's deadline (RewardPool runs rewards in its workers' main threads).
    # Passing None to disable them needs math-verify >= 0.8.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = final_answer(str(answer))
    gold = parse(gold_text, parsing_timeout=limit)
    if not gold:  # bare LaTeX such as x^2+1 is only recognised between $...$
        gold = parse(f"${gold_text}$", parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    pred = parse(final_answer(completion), parsing_timeout=limit)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=limit) else 0.0


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "math": math_answer,
}

# Imports a builtin needs, done when a worker starts so the first call's timeout excludes them.
_WARM_IMPORTS: dict[str, tuple[str, ...]] = {"math": ("math_verify",)}


# ---------------------------------------------------------------------------------------------
# Resolving a reward spec
# ---------------------------------------------------------------------------------------------


def resolve_reward(spec: str, recipe_dir: Path | str | None = None) -> RewardFn:
    """The reward named by ``builtin:NAME``, ``model:PATH`` or ``module:function`` (module
    beside the recipe first)."""
    from areal_cli.rollout import reward_model

    if spec.startswith(reward_model.PREFIX):
        folder = reward_model.model_path(spec, Path(recipe_dir) if recipe_dir else None)
        return reward_model.RewardModel(folder)
    prefix, sep, name = spec.partition(":")
    if not sep or not prefix or not name:
        raise ValueError(
            f"reward {spec!r}: expected builtin:NAME, model:PATH or module:function "
            f"(builtins: {', '.join(sorted(BUILTINS))})"
        )
    if prefix == "builtin":
        if name not in BUILTINS:
            raise ValueError(
                f"reward {spec!r}: unknown builtin {name!r}; choose one of {', '.join(sorted(BUILTINS))}"
            )
        return BUILTINS[name]
    try:
        return load_function(spec, Path(recipe_dir) if recipe_dir else None)
    except RecipeCodeError as exc:
        raise ValueError(f"reward {spec!r}: {exc}") from exc


def call_reward(fn: RewardFn, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
    """Call ``fn`` and check it returned a finite number.

    Sample fields named ``completion`` or ``answer`` are not passed again as keywords (the answer
    column is often called ``answer`` and already is the positional argument).
    """
    extra = {k: v for k, v in fields.items() if k not in ("completion", "answer")}
    value = fn(completion, answer, **extra)
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward returned {type(value).__name__}, not a number") from None
    if not _math.isfinite(score):
        raise ValueError(f"reward returned {score}")
    return score


# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    """One line naming an exception."""
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


# The worker is a fresh interpreter, not a multiprocessing child: spawn/forkserver re-import the
# parent's __main__ in every worker (slow, and broken for stdin or REPL mains), and fork is
# unsafe in a parent holding threads (asyncio, torch).
_WORKER_BOOT = "from areal_cli.rollout.rewards import _worker_entry; _worker_entry()"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def _worker_entry() -> None:
    """Worker process start: adopt the parent's sys.path, then serve calls on the socket in argv."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(int(sys.argv[2]))  # a reward that hangs must not outlive a killed controller
    conn = Connection(int(sys.argv[1]))
    try:
        spec, recipe_dir, parent_path = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = parent_path  # modules importable in the parent are importable here
    _worker_main(conn, spec, recipe_dir)


def _worker_main(conn: Connection, spec: str, recipe_dir: str | None) -> None:
    """Worker loop: resolve the reward, report ready, then answer calls until told to stop."""
    try:
        fn = resolve_reward(spec, recipe_dir)
        prefix, _, name = spec.partition(":")
        for module in _WARM_IMPORTS.get(name, ()) if prefix == "builtin" else ():
            importlib.import_module(module)
        if getattr(fn, "batched", False):
            fn.load()  # type: ignore[attr-defined]  # before "ready": the first call's timeout excludes it
    except BaseException as exc:
        conn.send(("fatal", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # parent went away
            return
        if request is None:
            return
        try:
            if request[0] == "batch":
                conn.send(("ok", fn.score_ids(request[1])))  # type: ignore[attr-defined]
                continue
            _, completion, answer, fields = request
            conn.send(("ok", call_reward(fn, completion, answer, fields)))
        except Exception as exc:
            conn.send(("error", _describe(exc)))


class _Worker:
    """One worker process and the parent's end of its socket."""

    def __init__(self, spec: str, recipe_dir: Path | None) -> None:
        parent_sock, child_sock = socket.socketpair()
        python_path = [_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in python_path if p)}
        with child_sock:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOT, str(child_sock.fileno()), str(spawner_pid())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.conn = Connection(parent_sock.detach())
        self.conn.send((spec, str(recipe_dir) if recipe_dir else None, list(sys.path)))
        self.ready = False

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def request_stop(self) -> None:
        """Ask a ready, idle worker to exit."""
        try:
            self.conn.send(None)
        except OSError:
            pass

    def exit_code(self, wait_s: float) -> int | None:
        """The exit code, waiting up to ``wait_s`` for a dying process; None if still running."""
        try:
            return self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kill the process (a hung reward may ignore SIGTERM), reap it and close the socket."""
        if self.alive():
            self.proc.kill()
        self.exit_code(5.0)
        self.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    """Kill every worker in the list (the pool's finalizer, also run at interpreter exit)."""
    for worker in workers:
        worker.kill()


async def _receive(conn: Connection, timeout_s: float) -> tuple[str, Any]:
    """The next message on ``conn``, waiting without blocking the event loop.

    Raises TimeoutError after ``timeout_s`` and EOFError when the worker died.
    """
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not readable.done():
            readable.set_result(None)

    fd = conn.fileno()
    loop.add_reader(fd, on_readable)
    try:
        await asyncio.wait_for(readable, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError from None
    finally:
        loop.remove_reader(fd)
    return conn.recv()


# ---------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardResult:
    """Outcome of one reward call; failed and timed-out calls have value 0.0."""

    value: float
    error: str | None = None
    timed_out: bool = False


class _Failed(Exception):
    """A call that failed in a way that leaves its worker unusable."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class RewardPool:
    """Runs a reward in ``num_workers`` worker processes with a per-call timeout.

    Use from one asyncio event loop at a time. ``score`` never raises for a reward's failure:
    errors and timeouts score 0.0 and increment ``n_errors`` / ``n_timeouts``.
    """

    def __init__(
        self,
        spec: str,
        recipe_dir: Path | str | None = None,
        *,
        num_workers: int = 1,
        timeout_s: float = 10.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0 or startup_timeout_s <= 0:
            raise ValueError("num_workers must be >= 1 and timeouts > 0")
        self.spec = spec
        self.recipe_dir = Path(recipe_dir) if recipe_dir else None
        # a bad spec fails here, in the caller, clearly
        self.batched = bool(getattr(resolve_reward(spec, self.recipe_dir), "batched", False))
        self._pending: list[tuple[list[int], asyncio.Future[RewardResult]]] = []
        self._flusher: asyncio.Task | None = None
        self._batches: set[asyncio.Task] = set()
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.n_calls = 0
        self.n_errors = 0
        self.n_timeouts = 0
        self.n_batches = 0  # requests that carried a batch (model rewards)
        self._workers = [self._spawn() for _ in range(num_workers)]
        # Kills workers even if close() is never called (pool garbage-collected, interpreter exit).
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self._idle: list[_Worker] = list(self._workers)
        self._waiters: deque[asyncio.Future[_Worker]] = deque()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: RewardConfig, recipe_dir: Path | str | None = None) -> RewardPool:
        """A pool for a recipe's ``RewardConfig``."""
        return cls(cfg.fn, recipe_dir, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)

    async def score(
        self,
        completion: str,
        answer: str,
        fields: Mapping[str, Any] | None = None,
        ids: list[int] | None = None,
    ) -> RewardResult:
        """Score one completion against its reference answer (``fields``: the rest of the row;
        ``ids``: the prompt's and completion's token ids, which a model reward scores)."""
        if self._closed:
            raise RuntimeError("reward pool is closed")
        if self.batched:
            return await self._score_in_batch(ids)
        worker = await self._acquire()
        self.n_calls += 1
        keep = False
        try:
            result = await self._call(worker, ("one", completion, answer, dict(fields or {})))
            keep = True
        except _Failed as failure:
            result = RewardResult(0.0, str(failure), failure.timed_out)
        except Exception as exc:  # e.g. unpicklable fields: still a scored-0 call, never a crash
            result = RewardResult(0.0, _describe(exc))
        finally:  # on cancellation too: a worker with a call in flight cannot be reused
            self._release(worker, keep)
        return self._count(result)

    def _count(self, result: RewardResult) -> RewardResult:
        if result.timed_out:
            self.n_timeouts += 1
        elif result.error is not None:
            self.n_errors += 1
        return result

    async def _score_in_batch(self, ids: list[int] | None) -> RewardResult:
        """Queue one sequence for the next batch and wait for its score."""
        self.n_calls += 1
        if not ids:
            return self._count(RewardResult(0.0, "a model reward needs the token ids to score"))
        future: asyncio.Future[RewardResult] = asyncio.get_running_loop().create_future()
        self._pending.append((list(ids), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return self._count(await future)

    async def _flush(self) -> None:
        """Send the queued sequences in batches of up to BATCH_MAX, each to a free worker."""
        while self._pending:
            await asyncio.sleep(BATCH_WAIT_S)  # let the calls that arrive together join
            take = [p for p in self._pending[:BATCH_MAX] if not p[1].done()]
            del self._pending[:BATCH_MAX]
            if take:
                task = asyncio.ensure_future(self._run_batch(take))
                self._batches.add(task)
                task.add_done_callback(self._batches.discard)

    async def _run_batch(self, take: list[tuple[list[int], asyncio.Future[RewardResult]]]) -> None:
        worker = await self._acquire()
        self.n_batches += 1
        keep = False
        try:
            values = await self._call(worker, ("batch", [ids for ids, _ in take]))
            keep = True
            if values.error is not None:
                results = [values] * len(take)
            else:
                results = [RewardResult(float(v)) for v in values.value]  # type: ignore[union-attr]
        except _Failed as failure:
            results = [RewardResult(0.0, str(failure), failure.timed_out)] * len(take)
        finally:
            self._release(worker, keep)
        for (_, future), result in zip(take, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _call(self, worker: _Worker, request: tuple) -> RewardResult:
        """Send one request to ``worker`` and wait for its answer; raises _Failed if it broke."""
        if not worker.ready:
            await self._wait_ready(worker)
        try:
            worker.conn.send(request)
        except (OSError, EOFError) as exc:
            raise _Failed(f"reward worker died: {_describe(exc)}") from exc
        try:
            kind, payload = await _receive(worker.conn, self.timeout_s)
        except TimeoutError:
            raise _Failed(f"reward timed out after {self.timeout_s:g}s", timed_out=True) from None
        except (EOFError, OSError):
            raise _Failed(f"reward worker died (exit code {worker.exit_code(1.0)})") from None
        if kind == "ok":
            return RewardResult(payload)
        return RewardResult(0.0, payload)

    async def _wait_ready(self, worker: _Worker) -> None:
        """Consume the worker's start-up message; raises _Failed if it cannot start."""
        try:
            kind, payload = await _receive(worker.conn, self.startup_timeout_s)
        except TimeoutError:
            raise _Failed(f"reward worker did not start in {self.startup_timeout_s:g}s") from None
        except (EOFError, OSError):
            raise _Failed(
                f"reward worker exited at start-up (exit code {worker.exit_code(1.0)})"
            ) from None
        if kind != "ready":
            raise _Failed(f"reward worker cannot load {self.spec!r}: {payload}")
        worker.ready = True

    def _spawn(self) -> _Worker:
        """Start a worker; it loads the reward in the background."""
        return _Worker(self.spec, self.recipe_dir)

    async def _acquire(self) -> _Worker:
        """An idle worker, waiting for one to be released if all are busy."""
        if self._idle:
            return self._idle.pop()
        waiter: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Cancelled just after being handed a worker: give it back rather than leak it.
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result(), keep=True)
            raise

    def _release(self, worker: _Worker, keep: bool) -> None:
        """Return a worker to the pool, replacing it first unless ``keep``."""
        if self._closed:
            worker.kill()
            return
        if not keep:
            worker.kill()
            self._workers.remove(worker)
            worker = self._spawn()
            self._workers.append(worker)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def close(self, grace_s: float = 2.0) -> None:
        """Stop every worker, killing busy or hung ones after ``grace_s``; idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in [self._flusher, *self._batches]:
            if task is not None and not task.done():
                task.cancel()
        for _, future in self._pending:
            if not future.done() and not future.get_loop().is_closed():
                future.set_exception(RuntimeError("reward pool is closed"))
        self._pending.clear()
        polite = [w for w in self._idle if w.ready and w.alive()]
        for worker in polite:
            worker.request_stop()
        deadline = time.monotonic() + grace_s
        for worker in polite:
            worker.exit_code(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # kills whatever is left (busy or hung workers)
        self._workers.clear()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_exception(RuntimeError("reward pool is closed"))

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Giving an inference engine's memory back while the trainer steps on the same devices
(colocated runs, `a|b` in the allocation), in SGLang's terms.

SGLang's /release_memory_occupation and /resume_memory_occupation take `tags`: "weights"
and "kv_cache" (None: both). The embedded engine honours them so:
  kv_cache  the running batch's KV buffers are freed (the engine frees them whenever its
            batch empties; releasing also keeps new requests from being admitted);
  weights   on a CPU the weights and the read buffers are dropped, and the next weight
            update (or the first request after resume, from the last folder loaded)
            reads them again: a colocated server loads a new version after every step
            anyway, so nothing is copied twice; on an accelerator they move to host
            memory and back, as SGLang's CPU backup does.
  cuda_graph  SGLang's third tag: the decode graphs (inference.graphs) and their memory
            pool are dropped. Every release drops them anyway (they record the addresses
            of the KV buffers and the weights), and they are captured again at their next
            use, so resuming this tag has nothing to do and it never holds requests back.
Released memory goes back to the operating system (`trim_host_memory`), so the server's
resident size falls by about its weights and KV cache while the trainer steps. Requests
that arrive meanwhile wait, as they do on a paused server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterable

MEMORY_TAGS = ("weights", "kv_cache")  # None means these
GRAPH_TAG = "cuda_graph"


class MemoryBusy(ValueError):
    """A release asked for while requests still run on the engine (or a look at weights
    that are released): the caller's order of calls is wrong, an HTTP 400."""


def parse_tags(tags: Iterable[str] | None) -> frozenset[str]:
    """SGLang's `tags` as a set (None: every tag); raises ValueError naming an unknown one."""
    if tags is None:
        return frozenset(MEMORY_TAGS)
    chosen = frozenset(tags)
    known = [*MEMORY_TAGS, GRAPH_TAG]
    unknown = sorted(chosen - set(known))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}: the tags are {known}")
    return chosen


def trim_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim, ~2 ms): without it the
    small tensors freed stay in the process's resident size. (No gc.collect: tensors go
    when their last reference does, and a collection costs ~50 ms in a server.)"""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def resident_mb() -> float:
    """This process's resident set size in MiB (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

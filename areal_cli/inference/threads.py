"""Which threads of an engine's process run torch's parallel CPU kernels: the scheduler's only.

torch's CPU kernels run on OpenMP (GNU libgomp in the PyPI builds). Every thread that runs
a parallel kernel gets a team of worker threads of its own, kept for as long as that thread
lives. Once a process has more of these threads than the machine has cores, libgomp stops
letting idle workers spin between kernels (its "throttled" spin, GOMP_SPINCOUNT), and each
kernel then waits for its workers to be woken. A decode step is ~1,000 small kernels, so
that wait is most of it: measured on a 2-core Xeon with AMX (2026-12-07), SmolLM2-135M in
bf16, one forward of 128 rows took 71-77 ms on a thread that was the only one with a team,
and 145 ms on a thread of a process whose main thread had loaded the weights (an element-
wise add on [128, 576]: 13 us against 60-80 us).

So the engine builds its model and runs every step on its scheduler thread (`own_cores`),
and the other threads of a server that touch tensors (weights read ahead, weights
received) run their kernels on one thread (`one_core`), which starts no team.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


def own_cores(threads: int) -> None:
    """Run this thread's parallel kernels on `threads` threads (the count is kept per
    thread by OpenMP; torch also keeps it as the default of threads that start later)."""
    torch.get_num_threads()  # torch's per-thread setup first: it would reset the count
    torch.set_num_threads(threads)


def one_core() -> None:
    """Run this thread's kernels on the calling thread alone: no team of workers. Other
    threads keep their counts, and threads started later torch's default (torch's own
    set_num_threads(1) would make that 1 for every thread not yet set up)."""
    torch.get_num_threads()  # torch's per-thread setup first: it would reset the count
    set_this_thread = _omp_set_num_threads()
    if set_this_thread is not None:
        set_this_thread(1)
    if torch.get_num_threads() != 1:  # no OpenMP symbols in reach, or not torch's runtime
        torch.set_num_threads(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """OpenMP's omp_set_num_threads, which sets the calling thread's count only (torch
    loads its OpenMP runtime into the process's global symbols)."""
    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return None

"""Builtin models (`model.path: builtin:NAME`), built locally and cached.

  tiny        ~1M-parameter Llama with a locally trained tokenizer (random weights)
  small       ~23M-parameter variant of tiny (for benchmarks)
  tiny-arith  tiny after a short supervised warm-up on single-digit addition (the demo)
  tiny-tool   tiny after a supervised warm-up on two-digit sums, some with an `add` tool
              call (the tool-agent recipe's start)

Each (name, seed) is built once into the cache (`$AREAL_CACHE_DIR`, default
`~/.cache/areal`), atomically, and then linked into the run directory. Builds are
deterministic on one kind of CPU, so a cached copy equals a fresh one there. Across CPU
kinds they are not bit for bit: torch's kernels for AMX, AVX-512 and AVX2 round
differently, and a few hundred training steps carry the difference into the weights. So
a warm-up must end well past what it is meant to teach, with a margin that such
differences cannot eat (tiny_tool_sft.yaml says how much tiny-tool's has). Two processes that need the same
model at once (two demos started together) build it once: the second waits on a lock file
beside the cache folder, then uses what the first built.

A build that takes long (tiny-arith's SFT run) reports its steps to `progress(done,
total)`, which callers show as a progress bar or a line every few seconds.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from areal_cli.config.schema import BUILTIN_MODELS

BUILD_VERSION = "v4"  # bump when a builder changes what it builds, so caches are not reused
MODEL_VERSIONS = {"tiny-tool": "v5"}  # a builder that changed alone: its own version
Progress = Callable[[int, int], None]  # (steps done, steps in all) of a build
# Builds a model that an SFT run makes (NAME, OUT, seed, progress): launch.builtins gives it.
BuildSFT = Callable[[str, Path, int, Progress | None], object]
SFT_BUILT = ("tiny-arith", "tiny-tool")  # made by the product's own SFT run, not built here


def cache_dir() -> Path:
    return Path(os.environ.get("AREAL_CACHE_DIR") or Path.home() / ".cache" / "areal")


def _build(
    name: str, seed: int, out: Path, build_sft: BuildSFT | None, progress: Progress | None
) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # One thread: in-process builds and the sampled evaluation of tiny-arith are only
    # deterministic (and cacheable) on one thread, and more threads on a busy 2-core
    # machine are slower, not faster. (tiny-arith's SFT run is a child process.)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if name in SFT_BUILT:
            if build_sft is None:
                raise ValueError(
                    f"builtin:{name} is made by an SFT run: build it through "
                    "areal_cli.launch.builtins (areal train and areal serve do)"
                )
            build_sft(name, out, seed, progress)
        else:
            from areal_cli.models.tiny_model import build_tiny_model

            build_tiny_model(out, preset=name, seed=seed)
    finally:
        torch.set_num_threads(threads)


def cached_path(name: str, seed: int) -> Path:
    """Where builtin model `name` for `seed` is (or will be) cached."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; choose from {', '.join(BUILTIN_MODELS)}")
    return cache_dir() / "models" / f"{name}-seed{seed}-{MODEL_VERSIONS.get(name, BUILD_VERSION)}"


def is_built(name: str, seed: int) -> bool:
    """Whether the cache holds builtin model `name` for `seed` (no build would happen)."""
    return (cached_path(name, seed) / "config.json").exists()


def build_cached(
    name: str,
    seed: int,
    build_sft: BuildSFT | None = None,
    progress: Progress | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """The cache folder of builtin model `name` for `seed`, built there on first use
    (`build_sft` makes the models in SFT_BUILT; `progress` sees a long build's steps, and
    `say` gets one line when a build starts or waits for another process's). Serve it
    from there; do not write into it."""
    cached = cached_path(name, seed)
    if (cached / "config.json").exists():
        return cached
    import fcntl

    say = say or (lambda line: None)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.parent / f".{cached.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is building builtin:{name}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cached / "config.json").exists():
            say(f"building builtin:{name} (first use only; then cached in {cached.parent})")
            _build(name, seed, cached, build_sft, progress)
    return cached


def materialize(name: str, seed: int, dest: Path, build_sft: BuildSFT | None = None) -> Path:
    """Put builtin model `name` (for `seed`) at `dest`, building it into the cache first
    (`build_sft` as for `build_cached`)."""
    cached = build_cached(name, seed, build_sft)
    if (dest / "config.json").exists():
        return dest
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for src in cached.iterdir():
            if src.is_file():
                try:
                    os.link(src, tmp / src.name)
                except OSError:
                    shutil.copy2(src, tmp / src.name)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest

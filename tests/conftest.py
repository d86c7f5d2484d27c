"""Shared test helpers: run the real `areal` CLI, snapshot a directory tree, and the tiny
models and tokenizer every package uses (built once per run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.launch.ports import free_port  # noqa: F401  (the tests' one helper for a free port)
from areal_cli.models.builtin import cache_dir

REPO = Path(__file__).resolve().parents[1]

# Building a model with transformers makes torch create its inductor cache folder, by
# default in /tmp; the test process keeps it in areal's cache, as the CLI does.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "torchinductor"))

# The test workers share the cores, so the processes of two tests overlap. OpenMP's
# default of spinning while it waits then starves the other test's processes: two SFT runs
# of one rank with 2 threads took 40 s side by side instead of 7.5 s. With PASSIVE a
# waiting thread sleeps (7.4 s -> 8.1 s for one run alone). Every child inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# `make test` runs three pytest-xdist workers, each taking a whole module at a time
# (--dist loadscope, so module fixtures are built once), in collection order
# (--no-loadscope-reorder: xdist would otherwise start with the modules that have the
# most tests, and leave the few long ones to the end). The modules whose tests run whole
# clusters, vLLM servers or many runs go first, longest first, so that the last ones
# handed out are short and the workers end together; the order within a module is kept.
_FIRST = (
    "tests/inference/test_vllm.py",
    "tests/slurm/",
    "tests/e2e/test_gpu_check.py",
    "tests/e2e/test_rm.py",
    "tests/e2e/test_train.py",
    "tests/gloo/test_tensor_parallel.py",
    "tests/e2e/test_sft.py",
    "tests/e2e/",
    "tests/gloo/",
)


def _start_rank(item: pytest.Item) -> int:
    path = Path(str(item.fspath)).relative_to(REPO).as_posix()
    return next((i for i, head in enumerate(_FIRST) if path.startswith(head)), len(_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: collection order within each group


# AREAL_TEST_CPU=FILE: each test's CPU seconds (user+sys of the worker and of every process
# it started and waited for, setup and teardown included) are appended to FILE, one line
# "seconds<TAB>wall<TAB>test id" per test. The suite's time is bound by CPU (about 1.7 of
# the 2 cores stay busy), so CPU, not wall time under contention, says what to cut:
#   AREAL_TEST_CPU=/tmp/cpu.tsv make test; sort -rn /tmp/cpu.tsv | head -40
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    out = os.environ.get("AREAL_TEST_CPU")
    if not out:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    start, wall = cpu(), time.monotonic()
    yield
    line = f"{cpu() - start:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n"
    with open(out, "a") as f:
        f.write(line)


_CPU_LOG_START = pytest.StashKey[int]()  # FILE's size when this session began: its lines are ours


def pytest_sessionstart(session: pytest.Session) -> None:
    out = os.environ.get("AREAL_TEST_CPU")
    if out and not hasattr(session.config, "workerinput"):  # the xdist controller, or no xdist
        session.config.stash[_CPU_LOG_START] = os.path.getsize(out) if os.path.exists(out) else 0


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """With AREAL_TEST_CPU: the session's CPU seconds in all, and its costliest modules."""
    out = os.environ.get("AREAL_TEST_CPU")
    start = config.stash.get(_CPU_LOG_START, None)
    if not out or start is None or not os.path.exists(out):
        return
    with open(out) as f:
        f.seek(start)
        rows = [line.rstrip("\n").split("\t") for line in f if line.count("\t") == 2]
    modules: dict[str, float] = {}
    for seconds, _, nodeid in rows:
        module = nodeid.split("::")[0]
        modules[module] = modules.get(module, 0.0) + float(seconds)
    total = sum(modules.values())
    terminalreporter.section(f"CPU seconds: {total:.0f} over {len(rows)} tests ({out})")
    for module, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")


def run_areal(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `python -m areal_cli.cli ARGS` as a user would; returns the finished process."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "areal_cli.cli", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def areal_in_process(*args: str) -> subprocess.CompletedProcess:
    """`areal ARGS` in this process (Typer's runner), for the calls that only refuse: the
    same code as `run_areal` without a child's interpreter and imports (~2 s each once
    torch is imported). A crash other than the CLI's own exit raises, so a test of "no
    traceback" cannot pass on an exception the runner swallowed."""
    from typer.testing import CliRunner

    from areal_cli.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def heavy_imports_after(code: str) -> tuple[list[str], list[str]]:
    """Run `code` in a fresh interpreter: the lines it printed, and the heavy modules it
    imported on the way (transformers' modeling code, `modeling_utils` and any model's
    `modeling_*`, and torch._dynamo: seconds of a process's start; our own decoder needs
    neither). Other transformers modules do not count: transformers 5.17's tokenizer
    module alone imports 218 image processors, which areal cannot avoid."""
    probe = (
        "\nimport json as _j, re as _r, sys as _s\n"
        "_h = _r.compile(r'torch\\._dynamo$|transformers\\.(modeling_utils$|models\\.[^.]+\\.modeling_)')\n"
        "print(_j.dumps(sorted(m for m in _s.modules if _h.match(m))))\n"
    )
    lines = subprocess.run(
        [sys.executable, "-c", code + probe], capture_output=True, text=True, check=True,
        timeout=120,
    ).stdout.splitlines()  # fmt: skip
    return lines[:-1], json.loads(lines[-1])


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write rows as a .jsonl file; returns its path as a string (a dataset.path)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


SKIP_DIRS = {
    ".venv",
    ".venv-vllm",
    ".git",
    "__pycache__",
    ".cache",
    ".pytest_cache",
    ".ruff_cache",
    "runs",
}


def snapshot(root: Path) -> dict[str, float]:
    """Every file and directory under root with its mtime, to prove nothing was written.

    Python's bytecode caches, the virtualenv and git internals are not ours to judge."""
    found = {}
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in subdirs + files:
            path = Path(directory) / name
            found[str(path.relative_to(root))] = path.stat().st_mtime
    return found


@pytest.fixture
def areal():
    return run_areal


# Tiny models and their tokenizer, built once per test run and shared by every package.


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "tiny" preset with seed 0."""
    from areal_cli.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed0", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_alt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as `tiny_model_dir`, different weights (seed 1)."""
    from areal_cli.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1", "tiny", seed=1)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer (a locally trained BPE with a chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)

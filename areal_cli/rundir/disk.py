"""Disk problems of the run directory: a full or read-only file system, told apart from
other failures so that the run stops with a message a person can act on instead of
relaunching a trainer that would fail the same way.

A failed write never leaves an entry that a reader takes (handoff protocol: unfinished
writes are `.tmp-*` folders, which no reader lists). After the writers are stopped,
`sweep` deletes those leftovers, which also gives their space back.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, VERSION_PREFIX, RunDir

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
# (folder, entry prefix) of everything the trainer writes in the run directory
TRAINER_ENTRIES = (
    ("weights", VERSION_PREFIX), ("recover", STEP_PREFIX), ("checkpoints", STEP_PREFIX),
)  # fmt: skip
ALL_ENTRIES = (*TRAINER_ENTRIES, ("rollouts", STEP_PREFIX))  # and the controller's


class DiskProblem(RuntimeError):
    """The run stops: its run directory's file system is full or read-only."""

    def __init__(self, run_dir: Path, problem: str) -> None:
        super().__init__(
            f"{problem}; {last_good(run_dir)} (no server loads an unfinished one). Free "
            "space or make it writable, then continue with areal train --resume"
        )


def diagnose(run_dir: Path, exc: BaseException | None = None) -> DiskProblem | None:
    """After the writers stopped: sweep their leftovers, then a DiskProblem when the file
    system of `run_dir` is full or read-only (or `exc` says so), else None."""
    sweep(run_dir, ALL_ENTRIES)
    problem = disk_problem(run_dir)
    if problem is None and exc is not None and is_disk_error(exc):
        problem = f"a write in {run_dir} failed: {exc}"
    return DiskProblem(run_dir, problem) if problem else None


def is_disk_error(exc: BaseException) -> bool:
    """A full disk, an exceeded quota or a read-only file system, anywhere in the chain."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def sweep(run_dir: Path, folders: tuple[tuple[str, str], ...] = TRAINER_ENTRIES) -> None:
    """Delete unfinished writes (`.tmp-*`, `.trash-*`) of writers that are stopped."""
    for folder, _ in folders:
        try:
            handoff.remove_stale(run_dir / folder)
        except OSError:
            pass  # a read-only file system: they stay, and no reader takes them


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


def largest_entry(run_dir: Path) -> int:
    """Bytes of the largest entry the trainer wrote (what its next write needs about)."""
    sizes = [0]
    for folder, prefix in TRAINER_ENTRIES:
        for entry in handoff.list_entries(run_dir / folder, prefix):
            sizes.append(sum(f.stat().st_size for f in entry.path.rglob("*") if f.is_file()))
    return max(sizes)


def disk_problem(run_dir: Path, needed: int | None = None) -> str | None:
    """What is wrong with the file system of `run_dir` (read-only, or less free space
    than `needed` bytes, by default the largest entry there; a probe write that fails),
    or None."""
    folders = [run_dir] + [run_dir / f for f, _ in ALL_ENTRIES if (run_dir / f).is_dir()]
    try:
        for folder in folders:  # (a folder may be a mount of its own)
            if os.statvfs(folder).f_flag & os.ST_RDONLY:
                return f"{folder} is on a read-only file system"
        st = os.statvfs(run_dir)
    except OSError as exc:
        return f"cannot read the file system of {run_dir}: {exc.strerror}"
    free = st.f_bavail * st.f_frsize
    needed = largest_entry(run_dir) if needed is None else needed
    if free < needed:
        return (
            f"the file system of {run_dir} is full: {_mb(free)} free of "
            f"{_mb(st.f_blocks * st.f_frsize)}, and an entry the trainer writes takes "
            f"{_mb(needed)}"
        )
    probe = run_dir / f".probe-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno in DISK_ERRNOS:
            return f"cannot write in {run_dir}: {exc.strerror}"
        return None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return None


def last_good(run_dir: Path) -> str:
    """The newest complete weights and recover entries, in words."""
    weights = handoff.latest(RunDir(run_dir).weights, VERSION_PREFIX)
    recover = handoff.latest(RunDir(run_dir).recover, STEP_PREFIX)
    return (
        f"the newest complete entries are weights/{weights.path.name if weights else '(none)'} "
        f"and recover/{recover.path.name if recover else '(none)'}"
    )

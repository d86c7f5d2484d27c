"""Where the run writes: its names (the run directory's folders) and a writable fileroot."""

from __future__ import annotations

import os
import re
from pathlib import Path

from areal_cli.config.checker import Checker

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_names(c: Checker) -> None:
    for key in ("experiment_name", "trial_name"):
        value = getattr(c.cfg, key)
        if not c.valid(key):
            continue
        if not value:
            c.error(key, "is required (it names the run directory)", f"set {key}: my-run")
        elif not _NAME.match(value):
            c.error(
                key,
                f"'{value}' is not a safe directory name",
                "use letters, digits, '.', '_' and '-' only",
            )


def check_fileroot(c: Checker) -> None:
    """A run writes under cluster.fileroot: it must be writable before anything starts."""
    if not c.valid("cluster.fileroot"):
        return
    existing = Path(c.cfg.cluster.fileroot).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    if read_only or not os.access(existing, os.W_OK):
        where = "is on a read-only file system" if read_only else "is not writable"
        c.error(
            "cluster.fileroot",
            f"{existing} {where}",
            "mount it read-write, or set cluster.fileroot to a folder you can write",
        )

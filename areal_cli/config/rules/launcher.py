"""The launcher's rules: several nodes (a trainer split evenly over them, or packed on one
under Ray) and the Slurm options."""

from __future__ import annotations

import re

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.checker import Checker


def check_nodes(c: Checker, mode: AllocationMode) -> None:
    """A trainer over several nodes runs the same number of ranks on each (torchrun's
    --nproc-per-node); on GPUs it also starts on a node boundary (the servers come first)."""
    cluster, world = c.cfg.cluster, mode.train.world_size
    gpn = cluster.n_gpus_per_node
    if c.cfg.launcher.type == "ray":  # one placement-group bundle holds every rank
        if gpn and world > gpn:
            c.error(
                "allocation_mode",
                f"under Ray the trainer's ranks are packed on one node, but {world} GPUs do not fit on a node of {gpn}",
                f"use fsdp:d{gpn} or fewer, or launcher.type: slurm for a trainer over several nodes",
            )
        return
    if gpn == 0:
        if world % cluster.n_nodes:
            c.error(
                "allocation_mode",
                f"the trainer's {world} ranks do not split evenly over cluster.n_nodes={cluster.n_nodes} nodes",
                f"use a multiple of {cluster.n_nodes} ranks, or fewer nodes",
            )
        return
    first = mode.n_servers * (mode.inference.per_replica_size if mode.inference else 0)
    if world > gpn and (first % gpn or world % gpn):
        c.error(
            "allocation_mode",
            f"the trainer's {world} GPUs start at GPU {first} and do not fill whole nodes of {gpn}",
            "give the servers whole nodes and the trainer a multiple of cluster.n_gpus_per_node GPUs",
        )


_SLURM_TIME = re.compile(
    r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+(:\d{2}(:\d{2})?)?|UNLIMITED|INFINITE)$"
)


def check_slurm(c: Checker) -> None:
    if not c.valid("launcher.type", "launcher.slurm") or c.cfg.launcher.type != "slurm":
        return
    slurm = c.cfg.launcher.slurm
    if slurm.time and not _SLURM_TIME.match(slurm.time):
        c.error(
            "launcher.slurm.time",
            f"{slurm.time!r} is not a Slurm time limit",
            "write minutes (90), HH:MM:SS (01:30:00) or D-HH:MM:SS (1-00:00:00)",
        )
    for key in ("extra_sbatch", "srun_args"):
        for i, item in enumerate(getattr(slurm, key)):
            if not item.startswith("-") or "\n" in item:
                c.error(
                    f"launcher.slurm.{key}[{i}]",
                    f"{item!r} is not one option: each item is one --option[=value], on one line",
                    "write each option as its own item, e.g. --constraint=a100",
                )
    for i, line in enumerate(slurm.preamble):
        if "\n" in line:
            c.error(
                f"launcher.slurm.preamble[{i}]",
                "holds a line break; the preamble takes one shell line per item",
                "split it into several items",
            )

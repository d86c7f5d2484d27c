"""A colocated trainer gives its devices back between steps (`a|b` in the allocation; the
controller's side is areal_cli.rollout.phases).

On a GPU the parameters (FSDP2's shards), the gradients and the optimizer state move to
host memory after each step and back before the next, while the servers generate on the
same GPU. On a CPU they live in host memory already, so nothing moves: the trainer's
threads sleep while it waits for its next batch, and the servers' use every core
meanwhile. The trainer tells the controller through its heartbeat (`holds_devices`,
trainer.state.give_back and take_devices, which alone call this and never twice in a row).
"""

from __future__ import annotations

import time

import torch
from torch import nn


class Offload:
    """Moves a set of models and their optimizers' state between `device` and the host."""

    def __init__(
        self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer], device: str
    ) -> None:
        self.modules, self.optimizers, self.device = modules, optimizers, torch.device(device)
        self._moved: list[tuple[dict, str]] = []  # optimizer-state entries that were on device

    @torch.no_grad()
    def to_host(self) -> float:
        """Parameters, gradients and optimizer state to host memory; the seconds taken."""
        start = time.perf_counter()
        for module in self.modules:
            module.to("cpu")
        self._moved = []
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device.type != "cpu":
                        state[key] = value.to("cpu")
                        self._moved.append((state, key))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return time.perf_counter() - start

    @torch.no_grad()
    def to_device(self) -> float:
        """Everything `to_host` moved, back on the device; the seconds taken."""
        start = time.perf_counter()
        for module in self.modules:
            module.to(self.device)
        for state, key in self._moved:
            state[key] = state[key].to(self.device)
        self._moved = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

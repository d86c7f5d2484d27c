"""What the supervised roles (`algorithm: sft`, `rm`; areal_cli.trainer.sft and .rm)
share: step k trains on the dataset's rows of step k, the held-out metrics come every
`eval_freq_steps` steps and at the last one (and once before training, carried on step
1's line as `NAME_initial`), and nothing is published (there is no server)."""

from __future__ import annotations

import time
from typing import Any

from areal_cli.rundir.records import TrainerStep
from areal_cli.trainer.state import Beat, Trainable, TrainerState, memory_mb, print0
from areal_cli.trainer.step import optimizer_step


def update(state: TrainerState, out: dict[str, float], beat: Beat) -> dict[str, float]:
    """The optimizer step after a supervised step's gradients; `out` gains grad_norm and
    lr (collective)."""
    a = state.actor
    beat("optimizer step")
    out["grad_norm"] = optimizer_step(
        a.model, a.optimizer, state.cfg.actor.optimizer.gradient_clipping
    )
    a.scheduler.step()
    out["lr"] = a.optimizer.param_groups[0]["lr"]
    return out


def eval_line(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items())


class SupervisedRole:
    """A role (state.Role) whose subclasses say how to train on step k's rows
    (`train_on`), how to evaluate (`evaluate`) and how often (`eval_freq_steps`)."""

    _initial: dict[str, float]
    _last: int

    @property
    def has_eval(self) -> bool:
        raise NotImplementedError

    def eval_freq_steps(self, cfg: Any) -> int:
        raise NotImplementedError

    def train_on(self, state: TrainerState, step: int, beat: Beat) -> dict[str, float]:
        """One optimizer step on step `step`'s rows; its figures (collective)."""
        raise NotImplementedError

    def evaluate(self, state: TrainerState, beat: Beat) -> dict[str, float]:
        """The held-out metrics, named eval_* (collective)."""
        raise NotImplementedError

    def models(self) -> dict[str, Trainable]:
        return {}

    def begin(self, state: TrainerState, done: int, last: int) -> None:
        """The held-out metrics before training, on a fresh start."""
        self._last, self._initial = last, {}
        if self.has_eval and done == 0:
            self._initial = self.evaluate(state, state.beat.phase)
            print0(f"[trainer] before training {eval_line(self._initial)}")

    def due(self, cfg: Any, step: int) -> bool:
        return self.has_eval and (step % self.eval_freq_steps(cfg) == 0 or step == self._last)

    def step(self, state: TrainerState, step: int) -> TrainerStep:
        """Train on step `step`'s rows; the held-out metrics when they are due."""
        start = time.perf_counter()
        in_step = state.in_step(step)
        figures = self.train_on(state, step, in_step)
        rss, state_mb, gpu_mb = memory_mb(state.actor.model, state.actor.optimizer)
        if gpu_mb:
            figures["peak_device_mb"] = gpu_mb
        train_s = time.perf_counter() - start
        line = (
            f"[trainer] step {step} loss {figures['loss']:.4f} grad_norm {figures['grad_norm']:.3f}"
        )
        if self.due(state.cfg, step):
            held_out = self.evaluate(state, in_step)
            figures.update(held_out)
            line += " " + eval_line(held_out)
        if step == 1:  # where the held-out curves start
            figures.update({f"{k}_initial": v for k, v in self._initial.items()})
        print0(line + f" train {train_s:.2f}s")
        return TrainerStep(step, train_s, figures, peak_rss_mb=rss, state_mb=state_mb)

"""The RL actor role (`algorithm: grpo`, `ppo`): train on the controller's rollouts and
publish the weights the servers load.

Step k (from 1) waits for RUN/rollouts/step-k (or DIR/step-k with `--batches`), trains
on it (areal_cli.trainer.step; a frozen reference model when `actor.kl_ctl > 0`, a frozen
teacher with `teacher.path` (on-policy distillation), and under PPO the critic, areal_cli.trainer.critic, through the step's `ValueModel`), then
publishes RUN/weights/vk. A resumed run first republishes the weights it restored, so
the servers continue from exactly them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from areal_cli.rundir import handoff
from areal_cli.rundir.batch import read_batch
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.layout import teacher_model_path
from areal_cli.rundir.paths import step_name, version_name
from areal_cli.rundir.records import TrainerStep
from areal_cli.trainer.critic import Critic, build_critic
from areal_cli.trainer.offload import Offload
from areal_cli.trainer.parallelize import build_sharded_model
from areal_cli.trainer.state import Trainable, TrainerState, build_optimizer, memory_mb, print0
from areal_cli.trainer.step import Teacher, train_step

POLL_S = 0.05


def wait_for_entry(
    parent: Path, name: str, fixed: bool, beat: Heartbeat
) -> tuple[handoff.Entry, float]:
    """Block until PARENT/NAME is a finished entry; returns it and the seconds waited."""
    start = time.perf_counter()
    path = parent / name
    announced = False
    beat.phase(f"wait for {parent.name}/{name}")
    watcher = None if fixed else handoff.Watcher(parent)
    try:
        while True:
            try:
                return handoff.read_entry(path), time.perf_counter() - start
            except handoff.IncompleteEntry:
                if watcher is None:
                    raise FileNotFoundError(
                        f"fixed batch {path} is missing or incomplete"
                    ) from None
                if not announced:
                    print0(f"[trainer] waiting for {path}")
                    announced = True
                watcher.wait(POLL_S)
    finally:
        if watcher is not None:
            watcher.close()


def frozen_model(model_dir: Path, state: TrainerState) -> nn.Module:
    """A frozen model sharded like the actor: a reference (RL under kl_ctl, DPO) or the
    distillation teacher (collective)."""
    cfg = state.cfg
    model = build_sharded_model(model_dir, state.mesh, cfg.actor.fsdp, dtype=cfg.model.dtype)
    model.eval().requires_grad_(False)
    return model


@dataclass
class ActorRole:
    """The RL actor, as the trainer's loop drives it (state.Role)."""

    batches: Path | None  # fixed batches DIR/step-K instead of RUN/rollouts
    ref_model: nn.Module | None  # frozen, when actor.kl_ctl > 0
    critic: Critic | None  # algorithm: ppo
    critic_checkpoints: Path | None = None  # where its checkpoints/step-K exports go
    teacher: Teacher | None = None  # frozen, with teacher.path (on-policy distillation)

    @classmethod
    def build(cls, state: TrainerState, batches: Path | None = None) -> ActorRole:
        """The reference model and the PPO critic, on the actor's mesh (collective)."""
        cfg, model_dir = state.cfg, state.actor.model_dir
        ref_model = frozen_model(model_dir, state) if cfg.actor.kl_ctl > 0 else None
        teacher = None
        if cfg.teacher.path:
            state.beat.phase("build teacher")
            model = frozen_model(Path(teacher_model_path(cfg, state.run.root)), state)
            t = cfg.teacher
            teacher = Teacher(model, t.rl_loss_weight, t.distill_loss_weight)
        critic = None
        if cfg.algorithm == "ppo":
            state.beat.phase("build critic")
            critic = build_critic(cfg, model_dir, state.run.root, state.mesh, build_optimizer)
        return cls(batches, ref_model, critic, state.run.critic_checkpoints, teacher)

    def describe(self) -> str | None:
        return None

    def models(self) -> dict[str, Trainable]:
        if self.critic is None:
            return {}
        c, checkpoints = self.critic, self.critic_checkpoints
        return {"critic": Trainable(c.model, c.optimizer, c.scheduler, c.model_dir, checkpoints)}

    def begin(self, state: TrainerState, done: int, last: int) -> None:
        """Join the weight-update group (method distributed); a resumed run republishes
        the restored weights: servers continue from them."""
        if state.sender is not None:
            state.beat.phase("join the weight-update group")
            state.sender.join()
        if done:
            state.export(done, "weights", {"step": done, "resumed": True})
        if state.colocated and state.mesh.mesh.device_type == "cuda":
            modules = [t.model for t in state.trainables().values()]
            modules += [self.ref_model] if self.ref_model is not None else []
            modules += [self.teacher.model] if self.teacher is not None else []
            optimizers = [t.optimizer for t in state.trainables().values()]
            state.offload = Offload(modules, optimizers, "cuda")
        state.give_back()

    def step(self, state: TrainerState, step: int) -> TrainerStep:
        """Wait for the batch, train on it, publish weights vK."""
        source = self.batches or state.run.rollouts
        entry, waited = wait_for_entry(
            source, step_name(step), self.batches is not None, state.beat
        )
        state.take_devices()
        state.beat.phase(f"step {step}: read batch")
        batch = read_batch(entry)
        t0 = time.perf_counter()
        a, cfg = state.actor, state.cfg
        stats = train_step(
            a.model, a.optimizer, a.scheduler, batch, cfg.actor, cfg.gconfig.temperature,
            self.ref_model, beat=state.in_step(step), layout=state.layout, critic=self.critic,
            policy_version=step - 1,  # the weights now: those after step-1 steps (v0: initial)
            teacher=self.teacher,
        )  # fmt: skip
        train_s = time.perf_counter() - t0
        state.beat.phase(f"step {step}: publish {version_name(step)}")
        t1 = time.perf_counter()
        state.export(step, "weights", {"step": step, "stats": stats})
        publish_s = time.perf_counter() - t1
        rss, state_mb, gpu_mb = memory_mb(a.model, a.optimizer)
        if gpu_mb:
            stats["peak_device_mb"] = gpu_mb
        print0(
            f"[trainer] step {step} loss {stats['loss']:+.4f} grad_norm {stats['grad_norm']:.3f} "
            f"clip {stats['clip_frac']:.3f} entropy {stats['entropy']:.3f} tokens {int(stats['tokens'])} "
            f"train {train_s:.2f}s wait {waited:.2f}s publish {publish_s:.2f}s"
        )
        return TrainerStep(step, train_s, stats, step, waited, publish_s, rss, state_mb)

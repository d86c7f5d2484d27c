"""The trainer's state, and the protocol of the roles that train it.

`TrainerState` holds what every role trains with: the mesh and this rank's step layout,
the actor (model, optimizer, LR schedule), the models a role adds beside it (the PPO
critic), the checkpointer and the heartbeat. It saves and loads itself: a recover entry
RUN/recover/step-K holds every model and optimizer (DCP), and in `state.json` the step and
each schedule (`scheduler`, and `NAME_scheduler` for a model NAME beside the actor), so
older run directories resume unchanged.

A `Role` (the RL actor of GRPO and PPO, SFT, the reward model) says what one step is:
`areal_cli.trainer.main` sets up the state and the role, then runs the loop

    done = state.resume()              # 0 on a fresh start
    role.begin(state, done, last)
    for step in done+1 .. last:  state.run_step(role, step)   # role.step, finish_step
    state.close(done + 1, last)

`finish_step` writes the step's line to RUN/logs/trainer-metrics.jsonl (rank 0) before
the recover entry: an entry for step K promises that steps up to K are on record, so a
kill between the two must lose the entry (the resume redoes the step and trims its line),
never the line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from areal_cli.config.schema import ExperimentConfig, ParallelStrategy
from areal_cli.models.lora import spec_of
from areal_cli.rundir import handoff
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.paths import STEP_PREFIX, RunDir, step_name, version_name
from areal_cli.rundir.records import TrainerStep
from areal_cli.trainer import collectives
from areal_cli.trainer.checkpoint import Checkpointer, load_recover, save_recover
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.mesh import TrainerMesh, build_mesh, step_layout
from areal_cli.trainer.offload import Offload
from areal_cli.trainer.parallelize import build_sharded_model
from areal_cli.trainer.weight_sender import WeightSender

Beat = Callable[[str], None]


def print0(*args: object) -> None:
    """Print from rank 0 only, flushed (one line per step)."""
    if collectives.rank() == 0:
        print(*args, flush=True)


@dataclass
class Trainable:
    """A model the trainer updates, with its optimizer and LR schedule; `model_dir` holds
    the config and tokenizer its HF exports carry, `checkpoints` the parent of its
    checkpoints/step-K exports."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    model_dir: Path
    checkpoints: Path


class Role(Protocol):
    """What the trainer's loop asks of a role (see the module docstring). Each is built
    from the state it trains (`build`, collective)."""

    def describe(self) -> str | None:
        """One line on what it trains on, for the log (None: nothing to say)."""
        ...

    def models(self) -> dict[str, Trainable]:
        """The models it trains beside the actor: saved and exported with it."""
        ...

    def begin(self, state: TrainerState, done: int, last: int) -> None:
        """Before the first step of this process (`done` steps are on record; the loop
        runs to `last`)."""
        ...

    def step(self, state: TrainerState, step: int) -> TrainerStep:
        """Train step `step` (collective); its record."""
        ...


def build_optimizer(
    model: nn.Module, cfg: ExperimentConfig, lr: float | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (or SGD) with linear warm-up, then constant, linear or cosine decay
    (actor.optimizer; `lr` replaces its learning rate, for the critic)."""
    o = cfg.actor.optimizer
    lr = o.lr if lr is None else lr
    params = [p for p in model.parameters() if p.requires_grad]
    if o.type == "adamw":
        optimizer = torch.optim.AdamW(
            params, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(params, lr=lr, weight_decay=o.weight_decay)
    total = max(1, cfg.total_train_steps * cfg.actor.ppo_n_minibatches)
    warmup = int(o.warmup_steps_proportion * total)

    def factor(i: int) -> float:
        return lr_factor(i, total, warmup, o.lr_scheduler_type, o.min_lr_ratio)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lr_factor(i: int, total: int, warmup: int, kind: str, min_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `i` (from 0) over the peak: linear warm-up over
    `warmup` steps, then `kind` (constant, linear or cosine) from 1 down to `min_ratio` at
    step `total`."""
    if i < warmup:
        return (i + 1) / warmup
    progress = min(1.0, (i - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if kind == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def vocab_size(model: nn.Module) -> int:
    """Rows of the LM head (the vocabulary as the model is built), or the config's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def memory_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float, float]:
    """Per rank, the largest over ranks (collective): peak resident memory so far, the
    MB of this rank's shards of parameters, gradients (of the trained ones) and optimizer
    state, and
    the peak of the GPU memory torch allocated (0 on a CPU)."""
    import resource

    def local_bytes(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", t)
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p) for p in model.parameters() if p.requires_grad)
    state = sum(
        local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    device = next(model.parameters()).device
    gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peak_rss, state_mb, gpu_mb = collectives.reduce_values(
        [rss / 2**20, (params + grads + state) / 2**20, gpu / 2**20], "max"
    )
    return peak_rss, state_mb, gpu_mb


@dataclass
class TrainerState:
    """What the trainer trains with, and how it saves, loads and exports it."""

    cfg: ExperimentConfig
    run: RunDir
    beat: Heartbeat
    mesh: TrainerMesh
    layout: StepLayout
    actor: Trainable
    checkpointer: Checkpointer = field(default_factory=Checkpointer)
    extra: dict[str, Trainable] = field(default_factory=dict)  # the role's `models()`
    sender: WeightSender | None = None  # weight_update.method: distributed
    colocated: bool = False  # '|': gives its devices back between steps (trainer.offload)
    offload: Offload | None = None  # colocated on a GPU: what moves (set by the role)

    @classmethod
    def build(
        cls,
        cfg: ExperimentConfig,
        run_dir: Path,
        beat: Heartbeat,
        device_type: str,
        strategy: ParallelStrategy,
        model_dir: Path,
    ) -> TrainerState:
        """The mesh of this torchrun world, the sharded actor from `model_dir`, its
        optimizer and schedule (collective)."""
        mesh = build_mesh(device_type, strategy)
        torch.manual_seed(cfg.seed)
        beat.phase("build model")
        lora = spec_of(cfg.actor)
        model = build_sharded_model(
            model_dir, mesh, cfg.actor.fsdp, **model_options(cfg), lora=lora, seed=cfg.seed
        )
        optimizer, scheduler = build_optimizer(model, cfg)
        run = RunDir(run_dir)
        actor = Trainable(model, optimizer, scheduler, model_dir, run.checkpoints)
        return cls(cfg, run, beat, mesh, step_layout(mesh, vocab_size(model)), actor)

    def trainables(self) -> dict[str, Trainable]:
        """Every model the state saves: the actor (as `model`), then the role's."""
        return {"model": self.actor, **self.extra}

    def in_step(self, step: int) -> Beat:
        """The heartbeat's phase setter, for phases inside step `step`."""
        return lambda phase: self.beat.phase(f"step {step}: {phase}")

    def resume(self) -> int:
        """Load the newest RUN/recover entry, if any; the steps it has done (0: none)."""
        entry = handoff.latest(self.run.recover, STEP_PREFIX)
        if entry is None:
            return 0
        self.beat.phase(f"load {entry.path.name}")
        extra = {name: (t.model, t.optimizer) for name, t in self.extra.items()}
        saved = load_recover(entry, self.actor.model, self.actor.optimizer, extra or None)
        for name, t in self.trainables().items():
            t.scheduler.load_state_dict(saved[_scheduler_key(name)])
        done = saved["step"]
        self.beat.steps_done = done
        print0(
            f"[trainer] resumed from {entry.path}: {done} steps done, going on with step {done + 1}"
        )
        return done

    def save(self, step: int) -> None:
        """Write recover entry RUN/recover/step-K: every model after `step` steps
        (collective)."""
        saved: dict[str, Any] = {"step": step}
        for name, t in self.trainables().items():
            saved[_scheduler_key(name)] = t.scheduler.state_dict()
        extra = {name: (t.model, t.optimizer) for name, t in self.extra.items()}
        a = self.actor
        keep = self.cfg.recover.keep_last
        save_recover(self.run.recover, step, a.model, a.optimizer, saved, keep, extra or None)

    def export(
        self, step: int, to: Literal["weights", "checkpoints"], meta: dict | None = None
    ) -> None:
        """The models after `step` steps as HF folders (collective). `weights`: the actor
        as RUN/weights/vK, which the servers load (`meta`: what the entry records);
        `checkpoints`: every model as step-K under its `checkpoints` folder."""
        if to == "weights" and self.sender is not None:
            keep = self.cfg.actor.weight_update.keep_last
            self.sender.publish(step, self.actor.model, meta or {}, keep)
            return
        if to == "weights":
            keep, prefix = self.cfg.actor.weight_update.keep_last, "v"
            targets = [(self.run.weights, version_name(step), self.actor)]
        else:
            keep, prefix = self.cfg.saver.keep_last, STEP_PREFIX
            targets = [(t.checkpoints, step_name(step), t) for t in self.trainables().values()]
        lora = spec_of(self.cfg.actor)
        for parent, name, t in targets:
            if lora is not None and t is self.actor:  # the adapters only, in PEFT's layout
                self.checkpointer.export_adapter(
                    parent, name, step, t.model, lora, t.model_dir, meta, keep, prefix=prefix
                )
                continue
            self.checkpointer.export_hf(
                parent, name, step, t.model, t.model_dir, meta, keep, prefix=prefix
            )

    def run_step(self, role: Role, step: int, final: bool = False) -> None:
        """Step `step` of `role`, then its line and saves; the heartbeat gets its time.
        A colocated trainer then gives its devices back; on a GPU not after the `final`
        step, whose export (`close`) reads the shards there: "done" gives them back."""
        start = time.perf_counter()
        record = role.step(self, step)
        on_device = self.offload is not None  # a GPU's saves and exports read the shards there
        if not on_device:  # nothing moves: the next rollout may go on beside the saves
            self.give_back()
        self.finish_step(record)
        self.beat.step_s = time.perf_counter() - start
        if not (on_device and final):
            self.give_back()

    def give_back(self) -> None:
        """Colocated: the devices to the servers until `take_devices` (on a GPU the
        parameters and optimizer state move to host memory: trainer.offload); the
        heartbeat says so (rollout.phases waits for it)."""
        if not self.colocated or not self.beat.holds_devices:
            return
        if self.offload is not None:
            self.beat.phase("offload to host memory")
            self.checkpointer.drop_plans()  # its views would hold the device memory
            print0(f"[trainer] offloaded to host memory in {self.offload.to_host():.2f}s")
        self.beat.holds_devices = False
        self.beat.phase("devices given back")

    def take_devices(self) -> None:
        """Colocated: the devices back, for a step or an export."""
        if not self.colocated or self.beat.holds_devices:
            return
        self.beat.holds_devices = True
        self.beat.phase("take the devices")
        if self.offload is not None:
            print0(f"[trainer] back on the devices in {self.offload.to_device():.2f}s")

    def finish_step(self, record: TrainerStep) -> None:
        """After a step's update: its line (rank 0), then the recover entry and the
        checkpoints when due (see the module docstring for the order)."""
        step = record.step
        if collectives.rank() == 0:
            lines = self.run.trainer_metrics
            lines.parent.mkdir(parents=True, exist_ok=True)
            with open(lines, "a") as f:
                f.write(record.to_json() + "\n")
        recover, saver = self.cfg.recover.freq_steps, self.cfg.saver.freq_steps
        if recover and step % recover == 0:
            self.beat.phase(f"step {step}: save recover checkpoint")
            start = time.perf_counter()
            self.save(step)
            print0(f"step {step}: recover checkpoint in {time.perf_counter() - start:.2f}s")
        if saver and step % saver == 0:
            self.beat.phase(f"step {step}: save checkpoint")
            self.export(step, "checkpoints")
        self.beat.steps_done = step

    def close(self, start: int, last: int) -> None:
        """After the loop (steps `start`..`last` ran here): the final checkpoint when the
        saver asks for one, and the background cleanup finished (collective)."""
        self.beat.phase("final barrier")
        collectives.barrier()
        final = self.run.checkpoint(last)
        # also when resumed at the end: the killed trainer may have died before writing it
        if self.cfg.saver.freq_steps == 0 and last > 0 and (last >= start or not final.exists()):
            self.take_devices()
            self.beat.phase("final checkpoint")
            self.export(last, "checkpoints")
        self.checkpointer.wait_for_cleanup()
        self.beat.holds_devices = False
        self.beat.phase("done")
        collectives.barrier()  # the process then exits without tearing gloo down (trainer.main)


def _scheduler_key(name: str) -> str:
    """Where a model's LR schedule sits in state.json: `scheduler` for the actor (the key
    older entries have), `NAME_scheduler` for a model beside it."""
    return "scheduler" if name == "model" else f"{name}_scheduler"


def model_options(cfg: ExperimentConfig) -> dict[str, Any]:
    """How the trained models are built (build_sharded_model's options)."""
    return {
        "dtype": cfg.model.dtype,
        "gradient_checkpointing": cfg.actor.gradient_checkpointing,
        "compile_layers": cfg.actor.compile,
    }

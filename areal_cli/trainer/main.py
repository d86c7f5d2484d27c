"""The trainer process, run by torchrun (one process per data-parallel rank).

    torchrun --nproc-per-node N ... -m areal_cli.trainer.main --config RUN/config.yaml
        [--batches DIR] [--steps S] [--run-dir DIR] [--resume]

Setup, then the loop, then cleanup:
  setup   process group (nccl on GPUs, gloo on CPU), device mesh, FSDP2 model, optimizer;
          with --resume, the newest RUN/recover/step-N entry restores everything.
  loop    for each step k, counted from 1 (see areal_cli.rundir.paths): wait for
          RUN/rollouts/step-k (or DIR/step-k with --batches), train, publish weights
          RUN/weights/vk, append one line of stats to RUN/logs/trainer-metrics.jsonl,
          and every recover.freq_steps write RUN/recover/step-k.
          Under a supervised role (algorithm: sft or rm) the batch is step k's rows of
          the dataset (see areal_cli.trainer.sft and .rm), with the held-out metrics
          every ROLE.eval_freq_steps, and nothing is published (there is no server).
          algorithm: rm trains a scalar head on the model's body: rank 0 first writes
          that model to RUN/model-rm (areal_cli.models.scalar_head) unless model.path
          already has a scalar head.
  cleanup final HF checkpoint under RUN/checkpoints when saver says so; destroy the group.

Each rank reports the phase it is in to RUN/heartbeat/trainer-<rank>.json (see
areal_cli.rundir.heartbeat), which the controller's watchdog reads; SIGUSR1 dumps its
stacks beside it. The process group has a timeout (trainer.collective_timeout_s), so a
rank left waiting in a collective fails with an error naming its phase instead of
hanging.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from areal_cli.config.schema import ExperimentConfig
from areal_cli.rundir import handoff
from areal_cli.rundir.batch import read_batch
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.paths import STEP_PREFIX, RunDir, step_name, version_name
from areal_cli.trainer import checkpoint
from areal_cli.trainer.parallelize import build_sharded_model, scalar_model
from areal_cli.trainer.step import train_step

POLL_S = 0.05


def print0(*args: object) -> None:
    """Print from rank 0 only, flushed (one line per step)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal_cli.trainer.main", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--config", required=True, type=Path, help="Resolved config.yaml of the run."
    )
    parser.add_argument(
        "--batches", type=Path, help="Train on fixed batches DIR/step-N instead of RUN/rollouts."
    )
    parser.add_argument(
        "--steps", type=int, help="Stop after this many steps (default: total_train_steps)."
    )
    parser.add_argument("--run-dir", type=Path, help="Run directory (default: from the config).")
    parser.add_argument(
        "--resume", action="store_true", help="Continue from the newest RUN/recover entry."
    )
    return parser.parse_args(argv)


def build_optimizer(
    model: torch.nn.Module, cfg: ExperimentConfig, lr: float | None = None
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
        if i < warmup:
            return (i + 1) / warmup
        progress = (i - warmup) / max(1, total - warmup)
        if o.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        if o.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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


def setup_distributed(cfg: ExperimentConfig) -> str:
    """Init the process group; returns the device type (cuda or cpu)."""
    use_cuda = cfg.cluster.n_gpus_per_node > 0 and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=cfg.trainer.collective_timeout_s)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    return "cuda" if use_cuda else "cpu"


def main(argv: list[str] | None = None) -> None:
    from areal_cli.config.loader import load_config
    from areal_cli.rundir.layout import run_dir_of
    from areal_cli.rundir.process import die_with_parent

    die_with_parent()  # a rank must not outlive torchrun (e.g. after kill -9 of the controller)
    args = parse_args(argv)
    cfg = load_config(args.config).config
    run_dir = args.run_dir or run_dir_of(cfg)
    beat = Heartbeat(run_dir, f"trainer-{os.environ.get('RANK', '0')}")
    beat.enable_stack_dump()
    try:
        train(args, cfg, run_dir, beat)
    except Exception as exc:
        # Name the phase: with a collective timeout this tells which collective never met.
        print(
            f"[trainer] rank {os.environ.get('RANK', '0')} failed in phase '{beat.last_phase}': "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            file=sys.stderr,
            flush=True,
        )
        raise


def train(args: argparse.Namespace, cfg: ExperimentConfig, run_dir: Path, beat: Heartbeat) -> None:
    """Setup, the loop over steps, cleanup (see the module docstring)."""
    from areal_cli.rundir.layout import initial_model_path
    from areal_cli.trainer.mesh import build_mesh, step_layout

    beat.phase("init process group")
    device_type = setup_distributed(cfg)
    mesh = build_mesh(device_type, cfg.allocation_mode)
    torch.manual_seed(cfg.seed)
    model_dir = Path(initial_model_path(cfg, run_dir))
    if cfg.algorithm == "rm":  # a scalar head on model.path's body, unless it has one
        beat.phase("add a scalar head")
        model_dir = scalar_model(model_dir, RunDir(run_dir).scalar_model, cfg.seed)
    build = {"dtype": cfg.model.dtype, "gradient_checkpointing": cfg.actor.gradient_checkpointing}
    beat.phase("build model")
    model = build_sharded_model(model_dir, mesh, cfg.actor.fsdp, **build)
    ref_model = None
    if cfg.actor.kl_ctl > 0:
        ref_model = build_sharded_model(
            model_dir, mesh, cfg.actor.fsdp, dtype=cfg.model.dtype
        ).eval()
        ref_model.requires_grad_(False)
    optimizer, scheduler = build_optimizer(model, cfg)
    critic = None
    if cfg.algorithm == "ppo":
        from areal_cli.trainer.critic import build_critic

        beat.phase("build critic")
        critic = build_critic(cfg, model_dir, run_dir, mesh, build_optimizer)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab_size = head.weight.shape[0] if head is not None else model.config.vocab_size
    layout = step_layout(mesh, vocab_size)
    role = None  # a supervised role (sft, rm): what each step trains on
    if cfg.algorithm == "sft":
        from areal_cli.trainer.sft import SFTData

        beat.phase("tokenize dataset")
        role = SFTData.from_config(cfg, model_dir, vocab_size)
    elif cfg.algorithm == "rm":
        from areal_cli.trainer.rm import RewardModelRole

        beat.phase("tokenize dataset")
        role = RewardModelRole.from_config(cfg, model_dir)
    if role is not None:
        print0(f"[trainer] {role.describe()}")
    start = 1  # the first step this process trains (steps count from 1)
    if args.resume and (entry := handoff.latest(RunDir(run_dir).recover, STEP_PREFIX)):
        beat.phase(f"load {entry.path.name}")
        state = checkpoint.load_recover(entry, model, optimizer, _extra(critic))
        scheduler.load_state_dict(state["scheduler"])
        if critic is not None:
            critic.scheduler.load_state_dict(state["critic_scheduler"])
        done = state["step"]
        start = done + 1
        beat.steps_done = done
        if role is None:  # republish the restored weights: servers continue from exactly them
            meta = {"step": done, "resumed": True}
            checkpoint.export_hf(
                RunDir(run_dir).weights,
                version_name(done),
                done,
                model,
                model_dir,
                meta,
                cfg.actor.weight_update.keep_last,
            )
        print0(
            f"[trainer] resumed from {entry.path}: {done} steps done, going on with step {start}"
        )
    last = min(
        cfg.total_train_steps, args.steps if args.steps is not None else cfg.total_train_steps
    )
    initial_eval = {}
    if role is not None and role.has_eval and start == 1:
        initial_eval = role.evaluate(cfg, model, layout, beat.phase)
        print0(f"[trainer] before training {_eval_line(initial_eval)}")
    for step in range(start, last + 1):
        if role is not None:
            record = run_supervised_step(
                step, cfg, model, optimizer, scheduler, role, beat, layout, last
            )
            if step == 1:  # where the held-out curves start
                record.update({f"{k}_initial": v for k, v in initial_eval.items()})
            finish_step(step, cfg, run_dir, model, optimizer, scheduler, model_dir, record, beat)
            continue
        run_one_step(
            step,
            cfg,
            run_dir,
            model,
            ref_model,
            optimizer,
            scheduler,
            model_dir,
            args.batches,
            beat,
            layout,
            critic=critic,
        )
    beat.phase("final barrier")
    dist.barrier()
    final = RunDir(run_dir).checkpoint(last)
    # also when resumed at the end: the killed trainer may have died before writing it
    if cfg.saver.freq_steps == 0 and last > 0 and (last >= start or not final.exists()):
        beat.phase("final checkpoint")
        _export_checkpoint(run_dir, last, model, model_dir, cfg)
        if critic is not None:
            _export_checkpoint(run_dir, last, critic.model, critic.model_dir, cfg, critic=True)
    checkpoint.wait_for_cleanup()
    beat.phase("done")
    dist.barrier()  # the process then exits without tearing gloo down (see __main__)


def _memory_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Per rank, the largest over ranks (collective): peak resident memory so far, and the
    bytes of this rank's shards of parameters, gradients (as large) and optimizer state."""
    import resource

    def local_bytes(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", t)
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    state = sum(
        local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures = torch.tensor([rss, 2 * params + state], dtype=torch.float64) / 2**20
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {"peak_rss_mb": float(figures[0]), "state_mb": float(figures[1])}


def _extra(critic) -> dict | None:
    """The models a recover entry holds beside the actor."""
    return {"critic": (critic.model, critic.optimizer)} if critic is not None else None


def _export_checkpoint(
    run_dir: Path, step: int, model, model_dir: Path, cfg: ExperimentConfig, critic: bool = False
) -> None:
    """The model after `step` steps as an HF folder RUN/checkpoints/step-K, or the PPO
    critic's as RUN/checkpoints/critic/step-K (collective)."""
    checkpoint.export_hf(
        RunDir(run_dir).critic_checkpoints if critic else RunDir(run_dir).checkpoints,
        step_name(step),
        step,
        model,
        model_dir,
        keep_last=cfg.saver.keep_last,
        prefix=STEP_PREFIX,
    )


def run_one_step(
    step,
    cfg,
    run_dir,
    model,
    ref_model,
    optimizer,
    scheduler,
    model_dir,
    batches_dir,
    beat,
    layout,
    critic=None,
) -> dict:
    """Wait for the batch, train on it, publish weights, log, checkpoint."""
    source = batches_dir or RunDir(run_dir).rollouts
    step_start = time.perf_counter()
    entry, waited = wait_for_entry(source, step_name(step), batches_dir is not None, beat)
    beat.phase(f"step {step}: read batch")
    batch = read_batch(entry)
    t0 = time.perf_counter()
    stats = train_step(
        model,
        optimizer,
        scheduler,
        batch,
        cfg.actor,
        cfg.gconfig.temperature,
        ref_model,
        beat=lambda phase: beat.phase(f"step {step}: {phase}"),
        layout=layout,
        critic=critic,
        policy_version=step - 1,  # the weights now: those after step-1 steps (v0: initial)
    )
    train_s = time.perf_counter() - t0
    beat.phase(f"step {step}: publish {version_name(step)}")
    t1 = time.perf_counter()
    meta = {"step": step, "stats": stats}
    checkpoint.export_hf(
        RunDir(run_dir).weights,
        version_name(step),
        step,
        model,
        model_dir,
        meta,
        cfg.actor.weight_update.keep_last,
    )
    publish_s = time.perf_counter() - t1
    record = {
        **_memory_mb(model, optimizer),
        "step": step,
        "weight_version": step,
        **stats,
        "train_s": train_s,
        "wait_s": waited,
        "publish_s": publish_s,
    }
    finish_step(step, cfg, run_dir, model, optimizer, scheduler, model_dir, record, beat, critic)
    print0(
        f"[trainer] step {step} loss {stats['loss']:+.4f} grad_norm {stats['grad_norm']:.3f} "
        f"clip {stats['clip_frac']:.3f} entropy {stats['entropy']:.3f} tokens {int(stats['tokens'])} "
        f"train {train_s:.2f}s wait {waited:.2f}s publish {publish_s:.2f}s"
    )
    beat.step_s = time.perf_counter() - step_start
    return record


def _eval_line(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def run_supervised_step(step, cfg, model, optimizer, scheduler, role, beat, layout, last) -> dict:
    """Train on step `step`'s rows; the held-out metrics when they are due."""
    start = time.perf_counter()
    in_step = lambda phase: beat.phase(f"step {step}: {phase}")  # noqa: E731
    stats = role.step(step, cfg, model, optimizer, scheduler, layout, in_step)
    record = {**_memory_mb(model, optimizer), "step": step, **stats}
    record["train_s"] = time.perf_counter() - start
    line = f"[trainer] step {step} loss {stats['loss']:.4f} grad_norm {stats['grad_norm']:.3f}"
    if role.due(cfg, step, last):
        record.update(role.evaluate(cfg, model, layout, in_step))
        line += " " + _eval_line({k: v for k, v in record.items() if k.startswith("eval_")})
    print0(line + f" train {record['train_s']:.2f}s")
    beat.step_s = time.perf_counter() - start
    return record


def finish_step(
    step, cfg, run_dir, model, optimizer, scheduler, model_dir, record, beat, critic=None
) -> None:
    """After a step's update: the step's line in RUN/logs/trainer-metrics.jsonl (rank 0),
    then the recover and saver checkpoints when due.

    The line comes first: a recover entry for step N promises that steps up to N are on
    record, so a kill between the two must lose the entry (the resume redoes the step and
    trims its line), never the line."""
    if dist.get_rank() == 0:
        lines = RunDir(run_dir).trainer_metrics
        lines.parent.mkdir(parents=True, exist_ok=True)
        with open(lines, "a") as f:
            f.write(json.dumps(record) + "\n")
    if cfg.recover.freq_steps and step % cfg.recover.freq_steps == 0:
        beat.phase(f"step {step}: save recover checkpoint")
        t2 = time.perf_counter()
        state = {"step": step, "scheduler": scheduler.state_dict()}
        if critic is not None:
            state["critic_scheduler"] = critic.scheduler.state_dict()
        checkpoint.save_recover(
            RunDir(run_dir).recover,
            step,
            model,
            optimizer,
            state,
            cfg.recover.keep_last,
            _extra(critic),
        )
        print0(f"step {step}: recover checkpoint in {time.perf_counter() - t2:.2f}s")
    if cfg.saver.freq_steps and step % cfg.saver.freq_steps == 0:
        beat.phase(f"step {step}: save checkpoint")
        _export_checkpoint(run_dir, step, model, model_dir, cfg)
        if critic is not None:
            _export_checkpoint(run_dir, step, critic.model, critic.model_dir, cfg, critic=True)
    beat.steps_done = step


if __name__ == "__main__":
    from areal_cli.rundir.process import exit_without_teardown

    main()
    exit_without_teardown()  # every output is fsynced and every rank passed the final barrier

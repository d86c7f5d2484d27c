"""The trainer process, run by torchrun (one process per data-parallel rank).

    torchrun --nproc-per-node N ... -m areal_cli.trainer.main --config RUN/config.yaml
        [--dp D --cp C --tp T] [--batches DIR] [--steps S] [--run-dir DIR] [--resume]

Setup, then the loop, then cleanup:
  setup   process group (nccl on GPUs, gloo on CPU), device mesh (the train side of the
          allocation, D x C x T ranks, as the launcher parsed it), FSDP2 model, optimizer
          (trainer.state.TrainerState), and the role (trainer.actor, .sft, .rm, .dpo); with
          --resume, the newest RUN/recover/step-N entry restores everything.
  loop    for each step k, counted from 1 (see areal_cli.rundir.paths): wait for
          RUN/rollouts/step-k (or DIR/step-k with --batches), train, publish weights
          RUN/weights/vk, append one line of stats to RUN/logs/trainer-metrics.jsonl,
          and every recover.freq_steps write RUN/recover/step-k.
          Under a supervised role (algorithm: sft, rm or dpo) the batch is step k's rows of
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
import os
import sys
from pathlib import Path

import torch

from areal_cli.config.schema import ExperimentConfig, ParallelStrategy
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.paths import RunDir
from areal_cli.trainer import collectives
from areal_cli.trainer.parallelize import scalar_model
from areal_cli.trainer.state import Role, TrainerState, print0
from areal_cli.trainer.weight_sender import WeightSender


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal_cli.trainer.main", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--config", required=True, type=Path, help="Resolved config.yaml of the run."
    )
    for dim, meaning in (("dp", "data"), ("cp", "context"), ("tp", "tensor")):
        parser.add_argument(
            f"--{dim}", type=int, help=f"Trainer {meaning}-parallel size (the allocation's)."
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
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="The servers share this trainer's devices ('|'): give them back between steps.",
    )
    parser.add_argument(
        "--weight-group",
        help="Publish weights over this group (JSON of rundir.weight_group.GroupSpec) "
        "instead of on disk (actor.weight_update.method: distributed).",
    )
    return parser.parse_args(argv)


def train_strategy(args: argparse.Namespace, world: int) -> ParallelStrategy:
    """The train side's sizes from --dp/--cp/--tp: cp and tp default to 1, dp to the
    ranks the world leaves (all of them when no flag is given)."""
    cp, tp = args.cp or 1, args.tp or 1
    dp = args.dp if args.dp is not None else max(1, world // (cp * tp))
    return ParallelStrategy(
        data_parallel_size=dp, context_parallel_size=cp, tensor_parallel_size=tp
    )


def setup_distributed(cfg: ExperimentConfig) -> str:
    """Init the process group (trainer.collectives); returns the device type (cuda or cpu)."""
    use_cuda = cfg.cluster.n_gpus_per_node > 0 and torch.cuda.is_available()
    return collectives.init(use_cuda, cfg.trainer.collective_timeout_s)


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
    beat.phase("init process group")
    device_type = setup_distributed(cfg)
    strategy = train_strategy(args, collectives.world_size())
    model_dir = initial_model(cfg, run_dir, beat)
    state = TrainerState.build(cfg, run_dir, beat, device_type, strategy, model_dir)
    if args.weight_group:
        state.sender = weight_sender(args.weight_group, cfg, run_dir)
    state.colocated = args.colocated
    role = build_role(state, args.batches)
    state.extra = role.models()
    if about := role.describe():
        print0(f"[trainer] {about}")
    last = min(
        cfg.total_train_steps, args.steps if args.steps is not None else cfg.total_train_steps
    )
    done = state.resume() if args.resume else 0
    role.begin(state, done, last)
    for step in range(done + 1, last + 1):
        state.run_step(role, step, final=step == last)
    state.close(done + 1, last)


def weight_sender(spec_json: str, cfg: ExperimentConfig, run_dir: Path) -> WeightSender:
    """The distributed weight path of --weight-group (the plan's group)."""
    import json

    from areal_cli.rundir.weight_group import GroupSpec

    spec = GroupSpec.from_json(json.loads(spec_json))
    bucket = int(cfg.actor.weight_update.bucket_mb * 2**20)
    return WeightSender(spec, RunDir(run_dir).weights, bucket)


def initial_model(cfg: ExperimentConfig, run_dir: Path, beat: Heartbeat) -> Path:
    """The folder the actor starts from; algorithm: rm trains a scalar head on the model's
    body, which rank 0 first writes to RUN/model-rm unless model.path already has one."""
    from areal_cli.rundir.layout import initial_model_path

    model_dir = Path(initial_model_path(cfg, run_dir))
    if cfg.algorithm == "rm":
        beat.phase("add a scalar head")
        model_dir = scalar_model(model_dir, RunDir(run_dir).scalar_model, cfg.seed)
    return model_dir


def build_role(state: TrainerState, batches: Path | None) -> Role:
    """The role `algorithm` names (collective: it may build models on the mesh)."""
    if state.cfg.algorithm == "sft":
        from areal_cli.trainer.sft import SFTRole

        return SFTRole.build(state)
    if state.cfg.algorithm == "rm":
        from areal_cli.trainer.rm import RewardModelRole

        return RewardModelRole.build(state)
    if state.cfg.algorithm == "dpo":
        from areal_cli.trainer.dpo import DPORole

        return DPORole.build(state)
    from areal_cli.trainer.actor import ActorRole

    return ActorRole.build(state, batches)


if __name__ == "__main__":
    from areal_cli.rundir.process import exit_without_teardown

    main()
    exit_without_teardown()  # every output is fsynced and every rank passed the final barrier

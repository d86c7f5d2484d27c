"""The Ray launcher (`launcher.type: ray`): the controller runs here, as with the local
launcher, and each process of the plan runs inside a Ray actor.

Connect: `launcher.ray.address` names a running cluster (`auto`, or host:port); empty
starts a local Ray for this run only: `ray start --head --block` on 127.0.0.1 under
areal_cli.launch.ray_head, which ends every Ray process of it when `stop_all` stops it or
when the controller dies, even by kill -9 (log: RUN/logs/ray-head.log).
A local Ray is pinned to loopback: Ray otherwise advertises the machine's first
non-loopback address; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes it use 127.0.0.1 on
Linux too. Ray 2.59 and later turn on token authentication for local clusters and
write the token under ~/.ray; areal gives its local Ray a random token in RAY_AUTH_TOKEN
instead (RAY_AUTH_MODE=token), so nothing is written under your home directory. To join
a cluster that uses tokens, export RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) as for any
Ray client.

Place: one placement group for the run, with one bundle per server replica (its CPUs or
GPUs) and one bundle that packs every trainer rank; strategy PACK. If the cluster cannot
hold it within `launcher.startup_timeout_s`, the run stops and says what it asked for.

Run: each bundle gets a `ProcessActor` that starts the process's command line with
Popen (its own process group, output to its log in the run directory, SIGKILL when the
actor's worker dies), reports its exit code and stops its whole group. A server's command
first runs areal_cli.launch.step, which records the actor node's address in
RUN/registry/ (the controller reaches servers there); the trainer's torchrun meets on the
trainer node's address. On GPUs, each process sees the GPUs Ray gave its actor.

Only the controller imports this module (and ray), when the recipe asks for Ray.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from areal_cli.launch.local import Child, LocalRunner, signal_group
from areal_cli.launch.plan import HEAD_NODE, LaunchPlan, ProcessSpec
from areal_cli.launch.ports import free_port
from areal_cli.launch.step import server_command
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.registry import HOST_ENV

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class RayPlacementError(RuntimeError):
    """The Ray cluster cannot hold the run's placement group."""


class ProcessActor:
    """One process of the plan, started and watched on the node Ray put this actor on."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen | None = None

    def start(
        self, argv: list[str], env: dict[str, str], log: str, cpus: list[int], gpus: bool
    ) -> dict:
        import ray

        from areal_cli.rundir.process import die_with_parent

        host = ray.util.get_node_ip_address()
        env = {**env, HOST_ENV: host}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ray.get_gpu_ids()))
        argv = [a.replace(HEAD_NODE, host) for a in argv]
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        if cpus:
            try:
                os.sched_setaffinity(self.popen.pid, cpus)
            except OSError:
                pass  # another machine's core numbers: run unpinned
        return {"pid": self.popen.pid, "host": host}

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`."""
        for sig in (signal.SIGTERM, signal.SIGCONT):
            signal_group(self.popen, sig)
        code = self.wait(grace_s)
        signal_group(self.popen, signal.SIGKILL)
        return code if code is not None else self.wait(5)


class RemoteProcess:
    """What the runner's callers use of a Popen (poll, wait, pid, returncode), for a
    process that a ProcessActor runs."""

    def __init__(self, actor: Any, started: dict) -> None:
        self.actor, self.pid, self.host = actor, started["pid"], started["host"]
        self.returncode: int | None = None

    def _ask(self, call: Any, timeout_s: float) -> int | None:
        import ray

        try:
            return ray.get(call, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError:  # the actor (or its node) died: so did the process
            return -signal.SIGKILL

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._ask(self.actor.poll.remote(), 30)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Poll until the process exits (the actor answers one call at a time, so it is
        never blocked in a long wait)."""
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ray actor", timeout)
            time.sleep(0.1)
        return self.returncode


class RayRunner(LocalRunner):
    """LocalRunner whose children run in Ray actors, one per bundle of the run's
    placement group (created here, in plan order)."""

    pin_cpus = False  # the actor pins its process

    def __init__(self, cfg: Any, plan: LaunchPlan) -> None:
        super().__init__()
        self.run_dir = Path(plan.run_dir)
        self.temp_dir: str | None = None
        if not cfg.launcher.ray.address:  # read by Ray when it is imported: set them first
            os.environ.update(LOOPBACK_ENV)
            os.environ.setdefault("RAY_AUTH_MODE", "token")
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        import ray
        from ray.util.placement_group import placement_group

        self.head: subprocess.Popen | None = None
        timeout_s = cfg.launcher.startup_timeout_s
        self._connect(ray, cfg, timeout_s)
        self.bundles = {p.name: i for i, p in enumerate(plan.processes)}
        asked = [_bundle(p) for p in plan.processes]
        self.group = placement_group(asked, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            have = ray.cluster_resources()
            self.stop_all()
            raise RayPlacementError(
                f"the Ray cluster could not place {asked} within {timeout_s:g}s (it has {have})"
            )
        # one call at a time, on the worker's main thread: the SIGKILL-on-parent-death that
        # Popen asks for is tied to the thread that forked
        self.actor_class = ray.remote(ProcessActor)

    def _connect(self, ray: Any, cfg: Any, timeout_s: float) -> None:
        address = cfg.launcher.ray.address
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            return
        # Short: Ray's socket paths must fit in 107 bytes. ray_head removes it at the end.
        self.temp_dir = tempfile.mkdtemp(prefix="areal-ray-")
        port = free_port()
        head = [
            str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={cfg.cluster.n_cpus or os.cpu_count() or 1}",
            f"--num-gpus={cfg.cluster.n_gpus_per_node}", "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]  # fmt: skip
        log = RunDir(self.run_dir).log("ray-head")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.head = subprocess.Popen(
                [sys.executable, "-m", "areal_cli.launch.ray_head", "--remove", self.temp_dir]
                + ["--", *head],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.init(address=f"127.0.0.1:{port}", log_to_driver=False, configure_logging=False)
                return
            except (ConnectionError, ray.exceptions.RayError) as exc:
                if self.head.poll() is not None or time.monotonic() > deadline:
                    raise RayPlacementError(
                        f"the local Ray head did not start ({exc}); log: {log}"
                    ) from None
                time.sleep(0.5)

    def start(self, spec: ProcessSpec, argv: list[str] | None = None) -> Child:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = _bundle(spec)
        actor = self.actor_class.options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundles[spec.name]
            ),
        ).remote()
        command = self.command(spec, argv or spec.argv)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | spec.env
        call = actor.start.remote(command, env, spec.log, spec.cpus, bool(spec.gpus))
        child = Child(spec, RemoteProcess(actor, ray.get(call)), list(argv or spec.argv))
        self.children.append(child)
        return child

    def command(self, spec: ProcessSpec, argv: list[str]) -> list[str]:
        if not spec.role.startswith("inference"):
            return argv
        return server_command(self.run_dir, spec.name, spec.ports[0], argv)

    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        _stop_actors([child], grace_s)
        self.children.remove(child)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every process, then the placement group, then the local Ray areal started."""
        import ray

        _stop_actors(self.children, grace_s)
        if ray.is_initialized():
            ray.shutdown()
        if self.head is not None:  # the local Ray that areal started, every process of it
            self.head.terminate()
            try:
                self.head.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.head.pid, signal.SIGKILL)
            self.head = None


def _stop_actors(children: list[Child], grace_s: float) -> None:
    import ray

    if not ray.is_initialized():
        return
    calls = [c.popen.actor.stop.remote(grace_s) for c in children if c.popen.returncode is None]
    try:
        ray.get(calls, timeout=grace_s + 30)
    except ray.exceptions.RayError:
        pass  # an actor that died took its process group with it
    for child in children:
        ray.kill(child.popen.actor)


def _bundle(spec: ProcessSpec) -> dict[str, float]:
    """A process's share of the placement group: its GPUs (and one CPU), or its cores."""
    if spec.gpus:
        return {"GPU": float(len(spec.gpus)), "CPU": 1.0}
    return {"CPU": float(max(1, len(spec.cpus)))}

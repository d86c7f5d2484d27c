"""Usage: python scripts/bench_weight_sync.py [--models small,smollm2] [--servers 1,2] [--versions 4]

The time from the trainer's optimizer step to every server serving the new version, for
actor.weight_update.method disk against distributed, measured in one run on this machine
with the real parts below the CLI:
  - a one-rank FSDP2 trainer under torchrun (this script's --probe mode) takes an
    optimizer step and publishes the version: disk writes RUN/weights/vK (the trainer's
    export_hf), distributed announces vK and broadcasts it over gloo (WeightSender);
  - 1 or 2 real embedded servers (float32, CPU) take it as a run's controller has them
    take it: WeightSync (read ahead, then /update_weights_from_disk) or GroupSync
    (/init_weights_update_group, then /update_weights_from_distributed per bucket).
The figure per version is handoff_total_s (from the moment the trainer started publishing,
right after its optimizer step, to every server reporting vK); the trainer pauses
between versions so they do not overlap. Models: builtin:small, and SmolLM2-135M-Instruct
from `make smollm2` (skipped when it is not built). Prints the median of the versions
and the ratio distributed / disk for each model and server count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAUSE_S = 2.0  # between versions: the servers are idle when the next one starts


def probe(args: argparse.Namespace) -> None:
    """--probe: the trainer (one rank): step, publish, pause, `versions` times."""
    import torch
    import torch.distributed as dist

    from areal_cli.config.schema import FSDPEngineConfig, ParallelStrategy
    from areal_cli.rundir.process import exit_without_teardown
    from areal_cli.rundir.weight_group import GroupSpec
    from areal_cli.trainer.checkpoint import Checkpointer
    from areal_cli.trainer.mesh import build_mesh
    from areal_cli.trainer.parallelize import build_sharded_model
    from areal_cli.trainer.weight_sender import WeightSender

    dist.init_process_group("gloo")
    model_dir, weights = Path(args.model), Path(args.weights)
    model = build_sharded_model(
        model_dir, build_mesh("cpu", ParallelStrategy()), FSDPEngineConfig()
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    sender = None
    if args.group:
        sender = WeightSender(GroupSpec.from_json(json.loads(args.group)), weights, 256 * 2**20)
        sender.join()
    checkpointer = Checkpointer()
    ids = torch.arange(16).unsqueeze(0)
    for version in range(1, args.versions + 1):
        model(input_ids=ids, use_cache=False).logits.float().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        t0 = time.perf_counter()
        if sender is not None:
            sender.publish(version, model, {}, keep_last=2)
        else:
            checkpointer.export_hf(weights, f"v{version}", version, model, model_dir, {}, 2)
        print(f"PUBLISH {version} {time.perf_counter() - t0:.4f}", flush=True)
        time.sleep(PAUSE_S)
    dist.barrier()
    exit_without_teardown()


def start_server(model: Path, port: int, root: Path) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "areal_cli.inference.server", "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--device", "cpu",
        "--weight-root", str(root), "--watch-weights", str(root / "weights"),
        "--max-running-requests", "4", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


async def controller(
    addresses: list[str],
    weights: Path,
    group: dict | None,
    versions: int,
    trainer: subprocess.Popen,
) -> list[dict[str, float]]:
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.state import LoopState
    from areal_cli.rollout.sync import GroupPlan, GroupSync, WeightSync
    from areal_cli.rundir.weight_group import GroupSpec

    client = InferenceClient(addresses, backend="embedded", retries=0)
    await client.wait_healthy(300)
    state = LoopState(version=0, next_step=1)
    if group is None:
        sync = WeightSync(client, weights, state)
    else:
        ranks = {a: 1 + i for i, a in enumerate(addresses)}
        sync = GroupSync(client, weights, state, GroupPlan(GroupSpec.from_json(group), ranks), 300)
    task = asyncio.create_task(sync.run())
    try:
        while state.version < versions:
            if task.done():
                task.result()
            if trainer.poll() not in (None, 0):
                raise RuntimeError("the trainer failed")
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    return [state.handoff[v] for v in range(1, versions + 1) if v in state.handoff]


def measure(model: Path, n_servers: int, method: str, versions: int) -> dict[str, float]:
    from areal_cli.launch.ports import free_port
    from areal_cli.rundir.weight_group import GroupSpec

    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        root = Path(tmp)
        weights = root / "weights"
        weights.mkdir()
        servers = [start_server(model, free_port(), root) for _ in range(n_servers)]
        addresses = [f"http://127.0.0.1:{s.args[s.args.index('--port') + 1]}" for s in servers]
        group = None
        if method == "distributed":
            group = GroupSpec("127.0.0.1", free_port(), 1 + n_servers, "gloo", 300.0).to_json()
        torchrun = str(Path(sys.executable).parent / "torchrun")
        # --log-dir inside the temp folder: torchrun's default leaves /tmp/torchelastic_*
        argv = [torchrun, "--standalone", "--nproc-per-node", "1", "--log-dir",
                f"{tmp}/torchrun", __file__, "--probe",
                "--model", str(model), "--weights", str(weights), "--versions", str(versions)]  # fmt: skip
        if group:
            argv += ["--group", json.dumps(group)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        try:
            # the servers load their model first, so their startup is not in the figures
            asyncio.run(_wait(addresses))
            trainer = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            figures = asyncio.run(controller(addresses, weights, group, versions, trainer))
            out, _ = trainer.communicate(timeout=600)
        finally:
            for s in servers:
                s.terminate()
            for s in servers:
                s.wait(60)
        publish = [
            float(line.split()[2]) for line in out.splitlines() if line.startswith("PUBLISH")
        ]
        return {
            "total_s": statistics.median(f["handoff_total_s"] for f in figures),
            "load_s": statistics.median(f["handoff_load_s"] for f in figures),
            "publish_s": statistics.median(publish),
        }


async def _wait(addresses: list[str]) -> None:
    from areal_cli.inference.client import InferenceClient

    client = InferenceClient(addresses, backend="embedded")
    try:
        await client.wait_healthy(300)
    finally:
        await client.close()


def model_folder(name: str) -> Path | None:
    if name == "smollm2":
        folder = Path(os.environ.get("AREAL_CACHE_DIR") or Path.home() / ".cache" / "areal")
        folder = folder / "models" / "smollm2-135m-instruct"
        return folder if (folder / "config.json").exists() else None
    from areal_cli.models.builtin import build_cached

    return build_cached(name, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,smollm2")
    parser.add_argument("--servers", default="1,2")
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args)
        return
    print(f"CPU: {_cpu()}; {os.cpu_count()} cores; medians of {args.versions} versions")
    print(
        f"{'model':<10} {'servers':>7} {'method':<12} {'step->all serve':>16} {'trainer publish':>16} {'servers take':>13} {'vs disk':>8}"
    )
    for name in args.models.split(","):
        model = model_folder(name)
        if model is None:
            print(f"{name}: not built (make smollm2); skipped")
            continue
        size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
        for n in (int(x) for x in args.servers.split(",")):
            disk = None
            for method in ("disk", "distributed"):
                r = measure(model, n, method, args.versions)
                disk = disk or r["total_s"]
                print(
                    f"{name + f' {size:.0f}MB':<10} {n:>7} {method:<12} {r['total_s']:>15.3f}s "
                    f"{r['publish_s']:>15.3f}s {r['load_s']:>12.3f}s {r['total_s'] / disk:>7.2f}x",
                    flush=True,
                )


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()

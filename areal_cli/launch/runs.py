"""The run lifecycle record (RUN/run.json) and what `areal ps / status / logs / stop` read.

`areal train` writes RUN/run.json atomically when the run's processes have started, again
whenever one is restarted, and once more when it ends:

  experiment, trial, launcher, job_id   (job_id: the Slurm job; none for the local launcher)
  host, controller_pid, children        (process name -> pid; under Slurm, the srun clients)
  recipe, total_steps, started
  state                                 pending | running | finished | failed | stopped
  ended, exit_code                      (once it ended)

A Slurm run is first recorded as pending when its job is submitted; its controller then
writes the rest from inside the job. A run whose record says running but whose controller
is gone (killed with -9, or the machine rebooted) is shown as `dead`, with `--resume` when
it has a recover entry. A local controller is checked by its pid; a Slurm run by its job
(`squeue`), from any host that sees the cluster. A local controller on another host
cannot be checked from here; it is shown as `running?`.
Only the standard library is imported here: these commands must start fast.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_cli.rundir import heartbeat, registry
from areal_cli.rundir.paths import CONFIG_FILE, STEP_PREFIX, RunDir
from areal_cli.rundir.records import is_eval_row

END_STATES = {0: "finished", 130: "stopped"}  # any other exit code: failed


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Write RUN/run.json atomically (temp file, then rename)."""
    path = RunDir(run_dir).record
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def start_record(
    cfg: Any, run_dir: Path, recipe: str, children: dict[str, int], run_id: str = ""
) -> None:
    record = {
        "experiment": cfg.experiment_name,
        "trial": cfg.trial_name,
        "run_id": run_id,  # its servers serve launch.plan.served_name(run_id)
        "launcher": cfg.launcher.type,
        "job_id": os.environ.get("SLURM_JOB_ID") if cfg.launcher.type == "slurm" else None,
        "host": socket.gethostname(),
        "controller_pid": os.getpid(),
        "children": children,
        "recipe": recipe,
        "total_steps": cfg.total_train_steps,
        "started": time.time(),
        "state": "running",
    }
    write_record(run_dir, record)


def submitted_record(
    cfg: Any, run_dir: Path, recipe: str, job_id: str | None, failed: str = ""
) -> None:
    """A Slurm job was submitted for the run, and its controller has not started yet; or
    with `failed`, the submission failed for that reason (no job)."""
    record = {
        "experiment": cfg.experiment_name,
        "trial": cfg.trial_name,
        "launcher": "slurm",
        "job_id": job_id,
        "host": socket.gethostname(),
        "controller_pid": None,
        "children": {},
        "recipe": recipe,
        "total_steps": cfg.total_train_steps,
        "started": time.time(),
        "state": "failed" if failed else "pending",
    }
    if failed:
        record["error"] = failed
    write_record(run_dir, record)


def update_children(run_dir: Path, children: dict[str, int]) -> None:
    """After a restart: the processes' new pids."""
    record = read_record(run_dir)
    if record is not None:
        record["children"] = children
        write_record(run_dir, record)


def end_record(run_dir: Path, exit_code: int) -> None:
    """The run ended with `exit_code` (no record: it never started a process)."""
    record = read_record(run_dir)
    if record is None or record.get("controller_pid") != os.getpid():
        return
    record.update(state=END_STATES.get(exit_code, "failed"), ended=time.time(), exit_code=exit_code)
    try:
        write_record(run_dir, record)
    except OSError:
        pass  # a full or read-only disk: the record keeps saying running; ps shows it dead


def read_record(run_dir: Path) -> dict | None:
    try:
        return json.loads(RunDir(run_dir).record.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie, or a reused pid, is not our controller
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _metrics_lines(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).metrics
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _has_recover(run_dir: Path) -> bool:
    recover = RunDir(run_dir).recover
    return recover.is_dir() and any(p.name.startswith(STEP_PREFIX) for p in recover.iterdir())


@dataclass
class RunView:
    """One run as `ps` and `status` show it."""

    run_dir: Path
    record: dict
    state: str
    step: int  # steps done: the last step of metrics.jsonl (steps count from 1)
    total: int
    last: dict  # the last metrics line
    age_s: float  # since the last metrics line (or the start)

    @property
    def score(self) -> str:
        if "reward_mean" in self.last:
            return f"reward {self.last['reward_mean']:.3f}"
        if "loss" in self.last:
            return f"loss {self.last['loss']:.4f}"
        return "-"


def view(run_dir: Path) -> RunView:
    """The run's state (see the module docstring), progress and last metrics."""
    record = read_record(run_dir) or {}
    state = record.get("state", "unknown")
    if state in ("running", "pending") and record.get("job_id"):
        state = _job_view(run_dir, record)
    elif state == "running":
        if record.get("host") != socket.gethostname():
            state = f"running? (on {record.get('host')})"
        elif not _alive(int(record.get("controller_pid", 0)) or -1):
            state = "dead: areal train --resume" if _has_recover(run_dir) else "dead"
    rows = [row for row in _metrics_lines(run_dir) if not is_eval_row(row)]  # steps
    last = rows[-1] if rows else {}
    since = float(last.get("time") or record.get("started") or time.time())
    total = int(record.get("total_steps") or 0)
    step = int(last.get("step", 0))
    return RunView(run_dir, record, state, step, total, last, time.time() - since)


def _job_view(run_dir: Path, record: dict) -> str:
    """A Slurm run's state from its job: pending, running, or dead once the job is gone."""
    from areal_cli.launch.slurm import SlurmError, job_state

    try:
        job = job_state(record["job_id"])
    except SlurmError:
        return f"{record['state']}? (squeue cannot tell)"
    if job is None:
        if record["state"] == "pending":
            return f"dead (job {record['job_id']} ended before its controller started)"
        return "dead: areal train --resume" if _has_recover(run_dir) else "dead"
    return "pending" if job in ("PENDING", "CONFIGURING") else "running"


def planned_names(run_dir: Path) -> list[str]:
    """The processes RUN/plan.json plans (server-0, trainer, ...); none without a plan."""
    try:
        plan = json.loads(RunDir(run_dir).plan.read_text())
    except (OSError, ValueError):
        return []
    return [p.get("name", "") for p in plan.get("processes", []) if isinstance(p, dict)]


def is_active(state: str) -> bool:
    """The run may still make progress (running, running?, pending)."""
    return state.startswith(("running", "pending"))


def find_runs(fileroot: Path) -> list[Path]:
    """Run directories under FILEROOT (FILEROOT/EXPERIMENT/TRIAL holding config.yaml)."""
    if RunDir(fileroot).config.is_file():
        return [fileroot]
    return sorted(p.parent for p in fileroot.glob(f"*/*/{CONFIG_FILE}"))


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def stop(run_dir: Path, timeout_s: float | None = None) -> str:
    """Stop a running run as Ctrl-C does (SIGTERM to its controller, which stops every
    process) and wait for it (`timeout_s`, by default as long as the run's controller
    may take); returns what happened, in words."""
    timeout_s = _stop_wait_s(run_dir) if timeout_s is None else timeout_s
    current = view(run_dir)
    record = current.record
    if not is_active(current.state):
        return f"not running ({current.state}); nothing to stop"
    if record.get("job_id"):
        from areal_cli.launch.slurm import SlurmError, stop_job

        try:
            said = stop_job(str(record["job_id"]), timeout_s)
        except SlurmError as exc:
            raise RuntimeError(str(exc)) from None
        if read_record(run_dir).get("state") in ("pending", "running"):  # no controller wrote it
            record.update(state="stopped", ended=time.time())
            write_record(run_dir, record)
        return said
    if current.state != "running":
        raise RuntimeError(f"its controller runs on {record.get('host')}; stop it there")
    pid = int(record["controller_pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"controller {pid} still running {timeout_s:g}s after SIGTERM")
        time.sleep(0.2)
    return f"stopped (controller {pid} and every process of the run)"


def _stop_wait_s(run_dir: Path) -> float:
    """How long a stopped controller may take: its loop's own bound on winding down (the
    run's launcher.stop_timeout_s) and then its children's stop (a grace of 10 s, then
    SIGKILL), with room to spare; at least 60 s."""
    import yaml

    from areal_cli.config.launcher_sections import LauncherConfig

    try:
        launcher = yaml.safe_load(RunDir(run_dir).config.read_text())["launcher"]
        wind_down = float(launcher["stop_timeout_s"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        wind_down = LauncherConfig.stop_timeout_s  # the default (a run from before the key)
    return max(60.0, wind_down + 30.0)


def _registered(run_dir: Path, name: str) -> str:
    """Where a server's job step said it runs (RUN/registry/NAME.json), or ''."""
    try:
        entry = json.loads(registry.entry_path(run_dir, name).read_text())
    except (OSError, ValueError):
        return ""
    node = f" on node {entry['node']}" if entry.get("node") else ""
    step = f", step {entry['job_id']}.{entry['step_id']}" if entry.get("step_id") else ""
    return f"  (server at {entry['host']}:{entry['port']}{node}{step})"


def ps_lines(run_dirs: list[Path]) -> list[str]:
    """`areal ps`: a header and one aligned line per run; RUN is what `areal status`,
    `logs` and `stop` take (the run directory, as FILEROOT was given)."""
    rows = [("EXPERIMENT", "TRIAL", "LAUNCHER", "JOB", "STATE", "STEP", "LAST", "AGE", "RUN")]
    for run_dir in run_dirs:
        v = view(run_dir)
        step = f"{v.step}/{v.total}" if v.total else str(v.step)
        job, launcher = str(v.record.get("job_id") or "-"), str(v.record.get("launcher", "-"))
        rows.append(
            (*run_dir.parts[-2:], launcher, job, v.state, step, v.score, age(v.age_s), str(run_dir))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def status_lines(run_dir: Path) -> list[str]:
    """`areal status`: state and progress, each process, each heartbeat's phase, and the
    last metrics line."""
    v = view(run_dir)
    out = [f"{run_dir}: {v.state}, step {v.step}/{v.total or '?'}, {v.score}"]
    if v.record.get("error"):
        out.append(f"  error: {v.record['error']}")
    here = v.record.get("host") == socket.gethostname()
    if v.record.get("job_id"):
        out.append(f"  slurm job {v.record['job_id']}, controller on {v.record.get('host')}")
    for name, pid in (v.record.get("children") or {}).items():
        alive = "running" if v.state == "running" and here and _alive(pid) else "gone"
        if v.state == "running" and not here:
            alive = f"on {v.record.get('host')}"
        where = _registered(run_dir, name)
        out.append(f"  {name:<10} pid {pid:<8} {alive}{where}")
    for name, beat in sorted(heartbeat.read_all(run_dir).items()):
        out.append(f"  {name:<10} phase: {beat.phase}")
    if v.last:
        shown = {k: x for k, x in v.last.items() if not k.endswith("_s") and k != "time"}
        out.append("  last metrics: " + json.dumps(shown))
    return out

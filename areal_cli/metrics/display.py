"""What a person sees during `areal train`, plus TensorBoard, wandb and the reward curve.

On a terminal: a rich live view with a progress bar, ETA, reward, staleness and
throughput. Otherwise (a pipe, CI, a log file): one plain line per step. At the end: a
summary table and RUN/reward_curve.png. Every sink also writes TensorBoard events under
RUN/tensorboard/ (when logging.tensorboard) and logs to wandb when logging.wandb.mode is
not disabled.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.progress import ProgressColumn
from rich.table import Column, Table
from rich.text import Text

from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.records import is_eval_row

SHOWN = (
    "reward_mean",
    "staleness_mean",
    "gen_tokens_per_s",
    "loss",
    "eval_loss",
    "eval_accuracy",
    "trainer_step_s",
    "handoff_latency_s",
)


def make_console(stderr: bool = False) -> Console:
    """A console for people: on a terminal, rich's own width; anywhere else (a pipe, a
    file, CI) nothing is wrapped or folded, so a path stays whole on its line."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr, highlight=False, emoji=False)
    return Console(stderr=stderr, highlight=False, emoji=False, soft_wrap=True, width=UNWRAPPED)


UNWRAPPED = 100_000  # the width of a console that is not a terminal: no line is ever wrapped


def make_sink(cfg: Any, run_dir: Path) -> Sink:
    """A live rich view on a terminal, plain lines otherwise (logging.display decides)."""
    mode = cfg.logging.display
    rich_view = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
    return Sink(cfg, run_dir, live=rich_view)


class Sink:
    """Receives status lines and per-step metrics from the controller."""

    def __init__(self, cfg: Any, run_dir: Path, live: bool):
        self.cfg, self.run_dir, self.live = cfg, run_dir, live
        # Plain mode writes to pipes and CI logs: never wrap a step line.
        self.console = Console(highlight=False, emoji=False) if live else make_console()
        self.stderr = make_console(stderr=True)
        for console in (self.console, self.stderr):  # rich would exit(1) on a closed pipe
            console.on_broken_pipe = lambda c=console: self._reader_gone(c)
        self._log = None  # opened on first use, once the run directory exists
        self.history: list[dict[str, float]] = []
        self._progress = None
        self._task = None
        self._tb = None
        self._wandb = None
        self._started = time.monotonic()
        self._start_step = 1

    # -- lifecycle
    def start(self, cfg: Any, start_step: int) -> None:
        """The run starts (or resumes) at step `start_step`: start_step-1 steps are done."""
        self._started = time.monotonic()
        self._start_step = start_step
        self._open_writers()
        if self.live:
            self._progress = progress_bar("train", self.console, with_info=True)
            self._task = self._progress.add_task(
                "train", total=cfg.total_train_steps, completed=start_step - 1, info="starting"
            )
            self._progress.start()

    def status(self, text: str) -> None:
        self._log_line(text)
        if self._progress is not None:
            self._progress.update(self._task, info=text)
        else:
            self._print(self.console, f"[areal] {text}")

    def step(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)
        self._write_events(metrics)
        line = _format(metrics)
        self._log_line(f"step {metrics['step']}/{self.cfg.total_train_steps} {line}")
        if self._progress is not None:
            self._progress.update(self._task, completed=metrics["step"], info=line)
        else:
            total = self.cfg.total_train_steps
            self._print(self.console, f"[areal] step {metrics['step']}/{total} {line}")

    def warn(self, text: str) -> None:
        """A warning line on stderr (and in the controller log)."""
        self._log_line(f"warning: {text}")
        if self._progress is not None:
            self._progress.console.print(f"warning: {text}", markup=False)
        else:
            self._print(self.stderr, f"warning: {text}")

    def notice(self, text: str) -> None:
        """A line on stderr that is no error (a stop that was asked for)."""
        self._log_line(text)
        self._stop_live()
        self._print(self.stderr, text)

    def error(self, text: str) -> None:
        self._log_line(f"error: {text}")
        self._stop_live()
        self._print(self.stderr, f"error: {text}")

    def _print(self, console: Console, text: Any) -> None:
        console.print(text, markup=False)

    def _reader_gone(self, console: Console) -> None:
        """A reader that went away (`areal train ... | head`) ends the output, not the
        run: rich calls this instead of exiting; the stream is pointed at /dev/null and
        the run goes on, its lines still in RUN/logs/controller.log."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, console.file.fileno())
        os.close(devnull)
        closed = "stdout" if console is self.console else "stderr"
        log = RunDir(self.run_dir).log("controller")
        line = f"{closed} was closed (its reader exited); the run goes on, logging to {log}"
        self._log_line(f"warning: {line}")
        if console is self.console:
            self.stderr.print(f"warning: {line}", markup=False)

    def finish(self, run_dir: Path) -> None:
        self._stop_live()
        self._close_writers()
        paths = RunDir(run_dir)
        history = read_metrics(paths.metrics)
        if not history:
            return
        elapsed = time.monotonic() - self._started
        self._print(self.console, summary_table(history, elapsed, self._start_step))
        if any("reward_mean" in h for h in history):
            path = plot_reward_curve(history, paths.reward_curve)
        else:  # a supervised role
            path = plot_loss_curve(history, paths.loss_curve)
        self._print(self.console, f"metrics: {paths.metrics}   curve: {path}")

    def _log_line(self, text: str) -> None:
        if self._log is None and not self.run_dir.is_dir():
            return  # before the run directory exists (bad input must write nothing)
        if self._log is False:
            return  # the disk refused it once (full or read-only): the console still shows
        try:
            if self._log is None:
                self._log = open_log(RunDir(self.run_dir).log("controller"))
            self._log.write(time.strftime("%H:%M:%S ") + text + "\n")
            self._log.flush()
        except OSError:
            self._log = False

    # -- writers
    def _open_writers(self) -> None:
        if self.cfg.logging.tensorboard:
            from areal_cli.metrics.tb_events import ScalarWriter

            self._tb = ScalarWriter(RunDir(self.run_dir).tensorboard)
        wandb_cfg = self.cfg.logging.wandb
        if wandb_cfg.mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity or None,
                mode=wandb_cfg.mode,
                name=f"{self.cfg.experiment_name}/{self.cfg.trial_name}",
                dir=str(self.run_dir),
            )

    def _write_events(self, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        if self._tb is not None:
            for key, value in metrics.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def _close_writers(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def _stop_live(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


ETA_AFTER = 5  # steps done before a time left is shown: the first ones include start-up


class Eta:
    """Time left from the rate since the first finished step: the start-up before it
    (imports, building the model) is not a step, and one rate over every step since
    moves little from one step to the next, where a short window swings with the load."""

    def __init__(self) -> None:
        self._first: tuple[float, int] | None = None

    def left(self, done: int, total: int, now: float) -> float | None:
        """Seconds left at `done` of `total` steps at time `now` (None: not known yet)."""
        if done > 0 and self._first is None:
            self._first = (now, done)
        if self._first is None or done >= total:
            return None
        since, at = self._first
        if done - at < min(ETA_AFTER, total - at) or now <= since:
            return None
        return (total - done) * (now - since) / (done - at)


def progress_bar(label: str, console: Console, with_info: bool = False):
    """A rich progress bar: label, N/M, time elapsed and left, bar (and the task's `info`
    field, with `with_info`). On a narrow terminal the info gives way first, dropping
    its last parts, so the step count and the time left always show."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [
        TextColumn(f"[bold]{label}", table_column=Column(no_wrap=True)),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
        _EtaColumn(table_column=Column(no_wrap=True)),
        BarColumn(bar_width=16 if with_info else None),
    ]
    if with_info:
        columns.append(_InfoColumn(table_column=Column(no_wrap=True, ratio=1, min_width=0)))
    return Progress(*columns, console=console, expand=with_info)


class _EtaColumn(ProgressColumn):
    """`eta H:MM:SS` by the rule of `Eta`, `eta -:--:--` until it is known."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._etas: dict[Any, Eta] = {}

    def render(self, task: Any) -> Text:
        eta = self._etas.setdefault(task.id, Eta())
        left = eta.left(int(task.completed), int(task.total or 0), time.monotonic())
        if left is None:
            return Text("eta -:--:--", style="progress.remaining")
        minutes, seconds = divmod(int(left + 0.5), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"eta {hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


class _InfoColumn(ProgressColumn):
    """The task's `info`: a line of parts joined by two spaces, as many as fit."""

    def render(self, task: Any) -> Any:
        return _Fitted(str(task.fields.get("info", "")))


class _Fitted:
    """Text that keeps as many of its parts (separated by two spaces) as fit the width
    it is given, and cuts a single part that does not."""

    def __init__(self, text: str) -> None:
        self.parts = text.split("  ")

    def __rich_console__(self, console: Any, options: Any) -> Any:
        width, kept = options.max_width, ""
        for part in self.parts:
            joined = f"{kept}  {part}" if kept else part
            if len(joined) > width:
                break
            kept = joined
        if not kept and self.parts:
            kept = self.parts[0][: max(0, width - 1)] + ("\u2026" if width > 0 else "")
        yield Text(kept, no_wrap=True, overflow="crop")

    def __rich_measure__(self, console: Any, options: Any) -> Measurement:
        return Measurement(0, len("  ".join(self.parts)))


class BuildProgress:
    """The progress of a long preparation (building a builtin model), as `progress(done,
    total)` calls: a rich bar with steps and time left on a terminal, else one plain line
    every `every_s` seconds (and one at the end), so a first run never looks hung."""

    def __init__(self, label: str, live: bool | None = None, every_s: float = 5.0) -> None:
        self.label, self.every_s = label, every_s
        self.live = sys.stderr.isatty() if live is None else live
        self.console = make_console(stderr=True)  # no emoji: builtin:x: stays as written
        self._bar = None
        self._task = None
        self._started = time.monotonic()
        self._last = 0.0
        self._done = -1
        self._eta = Eta()

    def __call__(self, done: int, total: int) -> None:
        if self.live:
            self._update_bar(done, total)
            return
        now = time.monotonic()
        seconds_left = self._eta.left(done, total, now)  # counts from the first step
        if done == self._done or (now - self._last < self.every_s and done < total):
            return
        self._done, self._last = done, now
        elapsed = now - self._started
        left = f", ~{seconds_left:.0f} s left" if seconds_left is not None else ""
        self.console.print(
            f"[areal] {self.label}: step {done}/{total}, {elapsed:.0f} s{left}", markup=False
        )

    def _update_bar(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = progress_bar(self.label, self.console)
            self._task = self._bar.add_task(self.label, total=total)
            self._bar.start()
        self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def open_log(path: Path):
    """Append-mode controller log (RUN/logs/controller.log)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a")  # noqa: SIM115 - lives as long as the run


def _format(m: dict[str, float]) -> str:
    if "reward_mean" not in m:  # a supervised role: no rollouts
        parts = [f"loss {m.get('loss', float('nan')):.4f}"]
        if "eval_loss" in m:
            parts.append(f"eval_loss {m['eval_loss']:.4f}")
        if "eval_accuracy" in m:
            parts.append(f"eval_accuracy {m['eval_accuracy']:.3f}")
        parts.append(f"train {m.get('trainer_step_s', 0):.2f}s")
        return "  ".join(parts)
    parts = [
        f"reward {m.get('reward_mean', float('nan')):.3f}",
        f"stale {m.get('staleness_mean', 0):.2f}/{m.get('staleness_max', 0):.0f}",
        f"gen {m.get('gen_tokens_per_s', 0):.0f} tok/s",
        f"loss {m.get('loss', float('nan')):+.4f}",
        f"train {m.get('trainer_step_s', 0):.2f}s",
        f"handoff {m.get('handoff_latency_s', float('nan')):.2f}s",
    ]
    return "  ".join(parts)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Every line of a metrics.jsonl, in step order."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(rows, key=lambda r: r["step"])


def summary_table(history: list[dict[str, float]], elapsed_s: float, start_step: int = 1) -> Table:
    """First, last-5 mean and overall figures of a run; its title says how many steps this
    process ran in `elapsed_s`, from `start_step` on (a resumed run ran the rest only)."""
    steps = [h for h in history if not is_eval_row(h)]  # eval rows: their own figures
    ran = [h["step"] for h in steps if h["step"] >= start_step]
    title = f"{len(ran)} steps in {elapsed_s:.0f}s"
    if start_step > 1 and ran:
        title += f" (steps {min(ran)}\u2013{max(ran)})"
    table = Table(title=title)
    for column in ("metric", "first step", "last 5 steps", "all steps"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for key in SHOWN:
        values = [h[key] for h in history if key in h]
        if not values:
            continue
        last = values[-5:]
        table.add_row(
            key,
            f"{values[0]:.3f}",
            f"{sum(last) / len(last):.3f}",
            f"{sum(values) / len(values):.3f}",
        )
    return table


def plot_reward_curve(history: list[dict[str, float]], path: Path) -> Path:
    """RUN/reward_curve.png: mean reward per step (steps count from 1 everywhere),
    with its std band clipped to the rewards actually seen (a 0/1 reward never shows a
    band above 1), and the eval rows' accuracy beside it (eval.freq_steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [h for h in history if is_eval_row(h)]  # eval.freq_steps
    history = [h for h in history if not is_eval_row(h)]
    steps = [h["step"] for h in history]
    mean = [h.get("reward_mean", float("nan")) for h in history]
    std = [h.get("reward_std", 0.0) for h in history]
    low = min((h["reward_min"] for h in history if "reward_min" in h), default=-math.inf)
    high = max((h["reward_max"] for h in history if "reward_max" in h), default=math.inf)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, mean, marker="o", markersize=3, label="mean reward")
    ax.fill_between(
        steps,
        [max(m - s, low) for m, s in zip(mean, std, strict=True)],
        [min(m + s, high) for m, s in zip(mean, std, strict=True)],
        alpha=0.2,
    )
    if evals:
        ax.plot(
            [h["step"] for h in evals],
            [h["eval_accuracy"] for h in evals],
            marker="s",
            markersize=4,
            label="eval accuracy",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05 if max(mean, default=1) <= 1 else None)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_loss_curve(history: list[dict[str, float]], path: Path) -> Path:
    """RUN/loss_curve.png for a supervised role: the training NLL per step (without label
    smoothing, so it compares with the held-out loss), and the held-out loss where it was
    measured (before the first step, then every ROLE.eval_freq_steps). A reward model's
    loss is per pair, and its held-out accuracy is drawn beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(
        [h["step"] for h in history],
        [h.get("nll", h["loss"]) for h in history],
        label="train (NLL)",
    )
    held = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    held[:0] = [(0, h["eval_loss_initial"]) for h in history if "eval_loss_initial" in h]
    if held:
        ax.plot(
            [step for step, _ in held],
            [value for _, value in held],
            marker="o",
            label="held-out loss",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("loss per pair" if "accuracy" in history[0] else "loss per target token")
    accuracy = [(h["step"], h["eval_accuracy"]) for h in history if "eval_accuracy" in h]
    accuracy[:0] = [
        (0, h["eval_accuracy_initial"]) for h in history if "eval_accuracy_initial" in h
    ]
    if accuracy:
        ax.plot(*zip(*accuracy, strict=True), marker="s", label="held-out pairwise accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Write the figure atomically (a temp file, then a rename) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path

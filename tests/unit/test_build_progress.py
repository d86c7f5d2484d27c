"""A first run never looks hung: a builtin model's build is announced only when it
happens, shows its steps, and two builds of the same model at once make it once."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
from rich.console import Console

from areal_cli.metrics.display import BuildProgress
from areal_cli.models import builtin


def _plain(every_s: float) -> tuple[BuildProgress, io.StringIO]:
    out = io.StringIO()
    progress = BuildProgress("building builtin:x", live=False, every_s=every_s)
    progress.console = Console(file=out, width=200, emoji=False)  # as make_console
    return progress, out


def test_plain_progress_prints_steps_and_time_left_every_few_seconds(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr("areal_cli.metrics.display.time.monotonic", lambda: now[0])
    progress, out = _plain(every_s=5.0)
    for done, at in ((0, 100.0), (10, 102.0), (20, 104.0), (30, 106.0), (50, 110.0), (250, 130.0)):
        now[0] = at
        progress(done, 250)
    lines = out.getvalue().splitlines()
    assert (
        lines
        == [
            "[areal] building builtin:x: step 0/250, 0 s",
            "[areal] building builtin:x: step 30/250, 6 s, ~44 s left",  # 20 steps in 4 s since 10: 220 at 5/s
            "[areal] building builtin:x: step 250/250, 30 s",  # the end, whatever the interval
        ]
    )


def test_a_build_is_announced_only_when_it_happens_and_made_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path))
    built: list[Path] = []
    release = threading.Event()

    def slow_build(name, seed, out, score, progress):  # stands in for the minutes of a build
        release.wait(10)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        built.append(out)

    monkeypatch.setattr(builtin, "_build", slow_build)
    said: list[str] = []
    first = threading.Thread(target=builtin.build_cached, args=("tiny", 0, None, None, said.append))
    first.start()
    while not said:  # the first holds the lock and builds
        pass
    second = threading.Thread(
        target=builtin.build_cached, args=("tiny", 0, None, None, said.append)
    )
    second.start()
    second.join(0.5)
    release.set()
    first.join(10)
    second.join(10)
    assert len(built) == 1
    assert said[0].startswith("building builtin:tiny (first use only; then cached in")
    assert said[1] == "another process is building builtin:tiny; waiting for it"
    assert len(said) == 2
    later: list[str] = []
    assert builtin.build_cached("tiny", 0, say=later.append) == built[0] and later == []


def test_the_time_left_waits_for_steps_and_counts_from_the_first() -> None:
    """No estimate from the start-up alone, none before a few steps, then one rate from
    the first step on (it moves little when one step is slow)."""
    from areal_cli.metrics.display import ETA_AFTER, Eta

    eta = Eta()
    assert eta.left(0, 100, 0.0) is None  # start-up: no step yet
    assert eta.left(1, 100, 20.0) is None  # the first step starts the clock
    assert eta.left(ETA_AFTER, 100, 24.0) is None  # 4 steps since: not enough
    assert eta.left(1 + ETA_AFTER, 100, 25.0) == pytest.approx(94 * 1.0)  # 1 s a step
    assert eta.left(1 + ETA_AFTER + 1, 100, 28.0) == pytest.approx(93 * 8 / 6)  # a slow one
    assert eta.left(100, 100, 200.0) is None  # done


@pytest.mark.parametrize("width", [80, 120])
def test_the_live_step_line_keeps_the_step_and_eta_first_on_a_narrow_terminal(width: int) -> None:
    """At 80 columns the step count and the time left show whole; the metrics after them
    drop their last parts to fit instead of cutting the line's start."""
    from areal_cli.metrics.display import _format, progress_bar

    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    bar = progress_bar("train", console, with_info=True)
    metrics = {
        "reward_mean": 0.312, "staleness_mean": 0.0, "staleness_max": 0, "gen_tokens_per_s": 491,
        "loss": 0.0737, "trainer_step_s": 0.39, "handoff_latency_s": 0.01,
    }  # fmt: skip
    bar.add_task("train", total=24, completed=3, info=_format(metrics))
    console.print(bar.get_renderable())
    (line,) = out.getvalue().splitlines()
    assert line.startswith("train  3/24 ") and "eta -:--:--" in line, line
    assert "reward 0.312" in line and "\u2026" not in line and len(line.rstrip()) <= width
    if width == 80:
        assert "handoff" not in line  # dropped whole, not cut
    else:
        assert "train 0.39s" in line


def test_a_resumed_run_says_how_many_steps_this_process_ran() -> None:
    from areal_cli.metrics.display import summary_table

    history = [{"step": s, "reward_mean": 0.5, "time": 0.0} for s in range(1, 201)]
    assert summary_table(history, 74.2).title == "200 steps in 74s"
    resumed = summary_table(history, 74.2, start_step=106).title
    assert resumed == "95 steps in 74s (steps 106\u2013200)"

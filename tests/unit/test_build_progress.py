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

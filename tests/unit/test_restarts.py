"""The restart limits: per process, within a sliding window."""

from __future__ import annotations

from areal_cli.launch.restarts import RestartBudget


def test_limits_count_per_process_within_the_window() -> None:
    budget = RestartBudget({"trainer": 1, "server": 2}, window_s=100.0)
    assert budget.take("server", "server-0", now=0.0)
    assert budget.take("server", "server-0", now=10.0)
    assert not budget.take("server", "server-0", now=20.0)  # a third within 100 s
    assert budget.take("server", "server-1", now=20.0)  # each server has its own count
    assert "2 restart(s) of server-0 within 100 s" in budget.refused("server", "server-0")
    assert "launcher.restarts.server: 2" in budget.refused("server", "server-0")
    assert budget.take("server", "server-0", now=101.0)  # the first one left the window
    assert budget.take("trainer", "trainer", now=0.0)
    assert not budget.take("trainer", "trainer", now=99.0)


def test_zero_means_never() -> None:
    budget = RestartBudget({"trainer": 0}, window_s=1.0)
    assert not budget.take("trainer", "trainer", now=0.0)

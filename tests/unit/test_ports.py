"""Free-port picks (`launch.ports`): below the kernel's ephemeral range, distinct, never a
port that something holds or that the caller avoids; the kernel's pick when there is no
room below."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from areal_cli.launch import ports


class Scripted:
    """A stand-in for the random source that returns the given ports in order."""

    def __init__(self, values: list[int]):
        self.values = list(values)

    def randrange(self, low: int, high: int) -> int:
        value = self.values.pop(0)
        assert low <= value < high
        return value


def test_picks_are_below_the_ephemeral_range_and_distinct() -> None:
    low, _ = ports.ephemeral_range()
    picked = ports.free_ports(8)
    assert len(set(picked)) == 8
    if low - ports.PICK_LOW >= ports.MIN_SPAN:
        assert all(ports.PICK_LOW <= p < low for p in picked), picked


def test_a_held_port_an_avoided_port_and_a_repeat_are_skipped() -> None:
    low, _ = ports.ephemeral_range()
    if low - ports.PICK_LOW < ports.MIN_SPAN:
        pytest.skip("this machine's ephemeral range leaves no room below it")
    held = socket.socket()
    try:
        held.bind(("", ports.free_ports(1)[0]))
        taken = held.getsockname()[1]
        avoided = ports.free_ports(1, avoid=(taken,))[0]
        free = ports.free_ports(1, avoid=(taken, avoided))[0]
        rng = Scripted([taken, avoided, free, free, free + 1 if free + 1 < low else free - 1])
        picked = ports.free_ports(2, avoid=(avoided,), rng=rng)  # type: ignore[arg-type]
    finally:
        held.close()
    assert picked[0] == free and taken not in picked and avoided not in picked
    assert len(set(picked)) == 2


def test_no_room_below_the_range_falls_back_to_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = tmp_path / "range"
    narrow.write_text("1024\t65000\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", narrow)
    assert ports.ephemeral_range() == (1024, 65000)
    picked = ports.free_ports(3)
    assert len(set(picked)) == 3 and all(p >= 1024 for p in picked)


def test_an_unreadable_range_file_means_linux_defaults(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    bad = tmp_path / "bad"
    bad.write_text("many\n")
    assert ports.ephemeral_range(bad) == (32768, 60999)

"""Free ports for servers and rendezvous, picked where outgoing connections cannot take them.

A port the kernel hands out for `bind(("", 0))` comes from the ephemeral range
(net.ipv4.ip_local_port_range, 32768-60999 on Linux by default), the same range every
outgoing TCP connection on the machine takes its local port from. Between the pick and the
moment the server binds it (seconds: a server imports torch first), or between a run and
its `--resume`, any client's connection can take that port, and the server then fails with
"address already in use" (seen in the suite: a resumed run's server, 2026-12-04). So the
picks here come from below the ephemeral range, where only a process that binds on purpose
can hold a port; each candidate is bound once to check that nothing holds it now. When the
range below is too small (a machine that widened its ephemeral range) the kernel's pick is
the fallback.

Only the standard library: `areal serve` and the plan import this.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PICK_LOW = 20000  # below: well-known services and other tools' fixed ports
MIN_SPAN = 2000  # fewer candidates than this below the ephemeral range: use the kernel's picks
TRIES = 200
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path | None = None) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default when the
    file is missing or unreadable)."""
    try:
        low, high = (int(x) for x in (path or _RANGE_FILE).read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(
    n: int, avoid: tuple[int, ...] = (), host: str = "", rng: random.Random | None = None
) -> tuple[int, ...]:
    """`n` distinct ports that nothing is bound to on `host` now, outside the ephemeral
    range when there is room (see the module docstring) and never one of `avoid`."""
    low, _ = ephemeral_range()
    picker = rng or random.SystemRandom()
    picked: list[int] = []
    holders: list[socket.socket] = []  # held until all are picked, so no pick repeats
    try:
        if low - PICK_LOW >= MIN_SPAN:
            for _ in range(TRIES):
                if len(picked) == n:
                    break
                port = picker.randrange(PICK_LOW, low)
                if port in avoid or port in picked:
                    continue
                sock = _bound(host, port)
                if sock is not None:
                    holders.append(sock)
                    picked.append(port)
        while len(picked) < n:  # no room below, or a crowded machine: the kernel's picks
            sock = _bound(host, 0)
            if sock is None:
                raise OSError("no free port to bind on this machine")
            holders.append(sock)
            port = sock.getsockname()[1]
            if port not in avoid:
                picked.append(port)
    finally:
        for sock in holders:
            sock.close()
    return tuple(picked)


def free_port(host: str = "127.0.0.1") -> int:
    """One port that nothing is bound to on `host` now (see `free_ports`)."""
    return free_ports(1, host=host)[0]


def _bound(host: str, port: int) -> socket.socket | None:
    """A socket bound to (`host`, `port`), or None when something holds the port. No
    SO_REUSEADDR: a port with connections still in TIME_WAIT is skipped too."""
    sock = socket.socket()
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock

"""What an inference server refuses, before it does anything: weights from outside the
allowed folders, and listening beyond this machine without an API key. No heavy import
(config only): `areal serve` checks the bind rule before it starts anything.

Weight roots: `/update_weights_from_disk` loads only from a folder inside one of the
roots the server was started with (`--weight-root DIR`, and `--watch-weights DIR`, the
run's weights/ folder). A path with a `..` component is refused as written; any other is
resolved (symlinks followed) and must stay inside a resolved root, so a symlink that leads
out is refused too. A server started with no root loads no weights over HTTP.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_cli.config.resolve import is_loopback


def weight_path_problem(path: str, roots: list[str]) -> str | None:
    """Why the server must not load weights from `path`, or None when it may."""
    if not roots:
        return "this server loads no weights over HTTP: it was started without --weight-root"
    if ".." in Path(path).parts:
        return f"{path} contains '..'; give a path inside the allowed roots"
    real = Path(os.path.realpath(path))
    for root in roots:
        if real.is_relative_to(os.path.realpath(root)):
            return None
    return f"{path} is outside the allowed weight roots ({', '.join(roots)})"


def bind_problem(host: str, api_key: str | None, insecure: bool) -> str | None:
    """Why a server must not listen on `host`, or None: beyond loopback it needs a key."""
    if is_loopback(host) or api_key or insecure:
        return None
    return (
        f"listening on {host} without an API key lets anyone who can reach it generate and "
        "load weights; give --api-key KEY, or --insecure-no-api-key if the network is yours"
    )


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now."""
    import socket

    with socket.socket() as sock:
        # Same option as the servers, so a port in TIME_WAIT does not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True

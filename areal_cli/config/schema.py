"""The recipe schema: typed dataclasses for every section of a recipe.

This is the one place that says which keys exist, their types, defaults, ranges and docs.
YAML is only data: `loader.load_config` turns a recipe into these classes, and
`rules.check_config` applies the cross-field rules. `python -m areal_cli.config.reference`
renders this file into docs/config-reference.md (a test keeps the two in sync).

Names follow AReaL's public vocabulary (`TrainEngineConfig`, `FSDPEngineConfig`,
`ParallelStrategy`, `SGLangConfig`, `allocation_mode`, `max_staleness`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_cli.config.fields import field, sub
from areal_cli.config.launcher_sections import LauncherConfig
from areal_cli.config.role_sections import CriticConfig, DPOConfig, RMConfig, SFTConfig


def torch_dtype(name: str) -> Any:
    """torch.float32 for "float32" or "fp32", and so on (imports torch: call it lazily)."""
    import torch

    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


# The one dtype table: the names recipes use; `torch_dtype` maps a name (or the short
# alias convert-checkpoint accepts) to torch.<name>.
DTYPES = ("float32", "bfloat16", "float16")
# what a recipe trains (`algorithm`); the supervised roles need no inference server
ALGORITHMS = ("grpo", "ppo", "sft", "rm", "dpo")
SUPERVISED = ("sft", "rm", "dpo")  # each reads the section of its own name (sft:, rm:, dpo:)
ROLE_SECTIONS = {
    "sft": "sft",
    "rm": "rm",
    "dpo": "dpo",
    "critic": "ppo",
}  # section -> the algorithm reading it
# the top-level sections and actor keys that only an RL algorithm reads
RL_SECTIONS = ("rollout", "gconfig", "reward", "inference", "eval", "teacher")
RL_ACTOR_KEYS = (
    "weight_update", "ppo_n_minibatches", "adv_estimator", "reward_norm", "adv_norm",
    "reward_scaling", "reward_bias", "reward_clip", "c_clip", "importance_sampling_level",
    "overlong_reward_penalty",
    "overlong_tokens", "overlong_penalty_factor", "mask_no_eos_with_zero",
    "eps_clip", "eps_clip_higher", "use_decoupled_loss", "behav_imp_weight_cap", "kl_ctl",
    "kl_estimator", "loss_agg_mode", "use_sapo_loss", "sapo_tau_pos", "sapo_tau_neg",
    "m2_threshold", "rejection_sampling", "prox_logp_method",
)  # fmt: skip
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BUILTIN_MODELS = (
    "tiny",
    "small",
    "tiny-arith",
    "tiny-tool",
)  # model.path: builtin:NAME (areal_cli.models)
# Their config.json fields that validation and --dry-run need before they are built
# (tests/inference/test_tiny_model.py checks them against a real build).
_TINY = {
    "model_type": "llama",
    "vocab_size": 781,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
BUILTIN_ARCHITECTURES = {
    "tiny": _TINY,
    "tiny-arith": _TINY,
    "tiny-tool": _TINY,
    "small": {
        **_TINY,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 7,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}
# Architectures with a tensor-parallel plan in the trainer, by config.json's model_type.
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ClusterSpecConfig:
    """The machines the launcher may use; a dry run plans against this declaration."""

    name: str = field("local", "A label for this cluster, shown in plans.")
    fileroot: str = field(
        "./runs",
        "Root directory for run outputs: FILEROOT/EXPERIMENT/TRIAL/ (a shared filesystem on clusters).",
    )
    n_nodes: int = field(1, "Number of nodes.", ge=1)
    n_gpus_per_node: int = field(
        0, "GPUs per node; 0 declares a CPU-only machine (servers and trainer share cores).", ge=0
    )
    n_cpus: int = field(
        0,
        "CPU cores to split between processes on a CPU-only machine; 0 means all cores seen at launch.",
        ge=0,
    )


@dataclass
class ModelConfig:
    """The policy model and its tokenizer."""

    path: str = field(
        "",
        "Hugging Face model folder, a hub id already in the local cache, or builtin:tiny / builtin:small (built locally).",
        path=True,
    )
    tokenizer_path: str = field(
        "", "Tokenizer folder; empty means the same as model.path.", path=True
    )
    dtype: str = field("float32", "Parameter dtype of the loaded model.", choices=DTYPES)
    seed: int = field(1, "Seed for builtin models (their random initialisation).", ge=0)


@dataclass
class OptimizerConfig:
    """The trainer's optimizer and learning-rate schedule."""

    type: str = field("adamw", "Optimizer.", choices=("adamw", "sgd"))
    lr: float = field(
        1e-5, "Peak learning rate.", gt=0, le=1.0, fix="use a small positive value such as 1e-5"
    )
    weight_decay: float = field(0.0, "Decoupled weight decay.", ge=0)
    beta1: float = field(0.9, "Adam beta1.", ge=0, lt=1)
    beta2: float = field(0.999, "Adam beta2.", ge=0, lt=1)
    eps: float = field(1e-8, "Adam epsilon.", gt=0)
    lr_scheduler_type: str = field(
        "constant",
        "Learning-rate schedule after warm-up.",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps_proportion: float = field(
        0.0, "Fraction of total steps used for linear warm-up.", ge=0, le=1
    )
    min_lr_ratio: float = field(
        0.0,
        "Where a linear or cosine schedule ends, as a fraction of lr (AReaL's min_lr_ratio).",
        ge=0,
        le=1,
    )
    gradient_clipping: float = field(
        1.0, "Clip the global gradient norm to this value; 0 disables.", ge=0
    )


@dataclass
class FSDPWrapPolicy:
    """Which modules FSDP2 shards as units."""

    transformer_layer_cls_to_wrap: list[str] = field(
        factory=list,
        doc="Module class names to shard one by one; empty means the model's _no_split_modules.",
    )


@dataclass
class FSDPEngineConfig:
    """FSDP2 settings of the trainer."""

    wrap_policy: FSDPWrapPolicy = sub(FSDPWrapPolicy)
    offload_params: bool = field(
        False,
        "Keep sharded parameters on the CPU between uses (CPUOffloadPolicy); needs an accelerator.",
    )
    memory_efficient_load: bool = field(
        False,
        "Rank 0 reads the weights and broadcasts them after sharding, instead of every rank reading.",
    )
    reshard_after_forward: bool = field(
        True, "Free gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2)."
    )
    param_dtype: str = field(
        "float32", "Dtype of gathered parameters used in compute (mixed precision).", choices=DTYPES
    )
    reduce_dtype: str = field(
        "float32", "Dtype of gradient reduction across ranks.", choices=DTYPES
    )


@dataclass
class MicroBatchSpec:
    """How a trainer step's batch is split into micro-batches."""

    n_mbs: int = field(1, "Minimum number of micro-batches per optimizer step on each rank.", ge=1)
    max_tokens_per_mb: int = field(
        8192,
        "Upper bound on tokens packed into one micro-batch (a longer sequence gets its own).",
        ge=1,
    )


@dataclass
class WeightUpdateConfig:
    """How new policy versions reach the inference servers."""

    method: str = field(
        "disk",
        "Transport: disk (versioned HF folders under RUN/weights/), or distributed (a "
        "process group of the trainer's rank 0 and the servers: NCCL on GPUs, gloo on CPUs; "
        "AReaL's xccl is read as distributed).",
        choices=("disk", "distributed", "xccl"),
    )
    bucket_mb: float = field(
        256.0,
        "distributed: the servers receive a version in buckets of about this many MB "
        "(one request each; a bigger tensor is a bucket of its own).",
        gt=0,
    )
    keep_last: int = field(
        2, "Keep this many published versions; older ones are garbage-collected.", ge=1
    )

    @property
    def distributed(self) -> bool:
        """Whether versions travel over the weight-update group (AReaL's xccl too)."""
        return self.method in ("distributed", "xccl")


NORM_LEVELS = ("group", "batch", "none")


@dataclass
class NormConfig:
    """A normalisation of rewards or advantages (AReaL's NormConfig); read with adv_estimator: custom."""

    mean_level: str = field(
        "none",
        "Subtract the mean of the prompt's group, of the whole batch, or nothing.",
        choices=NORM_LEVELS,
    )
    mean_leave1out: bool = field(
        False, "The mean leaves the sequence itself out (RLOO's baseline)."
    )
    std_level: str = field(
        "none",
        "Divide by the standard deviation over the group, the batch, or nothing.",
        choices=NORM_LEVELS,
    )
    std_unbiased: bool = field(False, "The standard deviation divides by n - 1 instead of n.")
    eps: float = field(1e-6, "Added to the standard deviation before dividing.", ge=0)


@dataclass
class RejectionSamplingConfig:
    """Decoupled PPO's filter on the behaviour importance weight pi_prox / pi_behave (AReaL's actor.rejection_sampling); behav_imp_weight_cap is its short form."""

    level: str = field(
        "token",
        "Judge each token alone, or each sequence as a whole (all its tokens share its fate; with metric ratio its weight is the sequence's geometric mean ratio).",
        choices=("token", "sequence"),
    )
    action: str = field(
        "mask",
        "mask: drop what is out of bounds from the loss; clamp: keep it with its weight clamped into [lower, upper] (metric ratio only).",
        choices=("mask", "clamp"),
    )
    metric: str = field(
        "ratio",
        "What the bounds apply to: the ratio pi_prox / pi_behave, or a KL estimate of it, kl_k1 (log r), kl_k2 ((log r)^2 / 2) or kl_k3 (1/r - 1 + log r).",
        choices=("ratio", "kl_k1", "kl_k2", "kl_k3"),
    )
    agg: str = field(
        "mean",
        "level sequence: the sequence's sum, mean or max of the metric over its tokens (the ratio's in log space: mean is the geometric mean).",
        choices=("sum", "mean", "max"),
    )
    upper: float | None = field(
        5.0, "Out of bounds above this; null with lower null turns the filter off."
    )
    lower: float | None = field(None, "Out of bounds below this; null: no lower bound.")


@dataclass
class TrainEngineConfig:
    """The actor: FSDP2 trainer, optimizer, micro-batching, weight publication and PPO loss."""

    optimizer: OptimizerConfig = sub(OptimizerConfig)
    fsdp: FSDPEngineConfig = sub(FSDPEngineConfig)
    mb_spec: MicroBatchSpec = sub(MicroBatchSpec)
    weight_update: WeightUpdateConfig = sub(WeightUpdateConfig)
    gradient_checkpointing: bool = field(False, "Recompute activations in backward to save memory.")
    compile: bool = field(
        False,
        "torch.compile each decoder layer of areal's own decoder (Llama, Mistral, Qwen2/3), "
        "attention left eager; costs a compile at the first steps (about a minute on a CPU). "
        "Off by default: it has not been measured faster yet.",
    )
    ppo_n_minibatches: int = field(
        1, "Optimizer steps per trainer step (the batch is split into this many).", ge=1
    )
    adv_estimator: str = field(
        "grpo",
        "Advantage estimator: grpo (group mean/std), dr_grpo (no std), rloo (leave-one-out), reinforce_pp (REINFORCE++ baseline), or custom: reward_norm then adv_norm as given.",
        choices=("grpo", "dr_grpo", "rloo", "reinforce_pp", "custom"),
    )
    reward_norm: NormConfig = sub(NormConfig)
    adv_norm: NormConfig = sub(NormConfig)
    reward_scaling: float = field(
        1.0, "Rewards are mapped to (reward + reward_bias) * reward_scaling."
    )
    reward_bias: float = field(0.0, "See reward_scaling.")
    reward_clip: float | None = field(
        None, "Then clipped to [-reward_clip, reward_clip]; null: no clipping.", gt=0
    )
    overlong_reward_penalty: bool = field(
        False,
        "DAPO's overlong penalty: a completion longer than gconfig.max_new_tokens - overlong_tokens loses up to overlong_penalty_factor of reward.",
    )
    overlong_tokens: int = field(
        0, "The length before max_new_tokens where the overlong penalty starts.", ge=0
    )
    overlong_penalty_factor: float = field(1.0, "The overlong penalty at max_new_tokens.", ge=0)
    mask_no_eos_with_zero: bool = field(
        False, "A completion cut at max_new_tokens (no EOS) gets advantage 0 after reward_norm."
    )
    eps_clip: float = field(
        0.2,
        "PPO clip range below 1 (and above, unless eps_clip_higher is set); 0 clips the ratio to 1 (AReaL's M2PO example sets it).",
        ge=0,
        lt=1,
    )
    eps_clip_higher: float | None = field(
        None, "Upper clip range (DAPO's clip-higher); null means eps_clip.", gt=0
    )
    importance_sampling_level: str = field(
        "token",
        "PPO's ratio per token, or per sequence: the geometric mean over its tokens (GSPO).",
        choices=("token", "sequence"),
    )
    c_clip: float | None = field(
        None,
        "Dual clip: a token with negative advantage loses at most c_clip * |advantage|; null disables.",
        gt=1,
    )
    use_decoupled_loss: bool = field(
        True,
        "Decoupled PPO: clip against recomputed proximal logprobs and weight by proximal/behaviour ratio.",
    )
    behav_imp_weight_cap: float | None = field(
        None,
        "Short form of rejection_sampling {metric: ratio, level: token, action: mask, upper: CAP}: tokens whose proximal/behaviour importance weight exceeds it are dropped. null: rejection_sampling decides.",
        gt=1,
    )
    rejection_sampling: RejectionSamplingConfig = sub(RejectionSamplingConfig)
    prox_logp_method: str = field(
        "recompute",
        "Decoupled PPO's proximal logprobs when a separate pass would be needed (ppo_n_minibatches > 1, stale tokens): recompute (a no-grad forward), loglinear (skip it: interpolate between behaviour and current logprobs by version), or metrics (recompute, and log how far the approximations are).",
        choices=("recompute", "loglinear", "metrics"),
    )
    kl_ctl: float = field(
        0.0, "Coefficient of the KL penalty to the reference (initial) policy; 0 disables.", ge=0
    )
    kl_estimator: str = field("k3", "KL estimator: k1, k2 or k3.", choices=("k1", "k2", "k3"))
    loss_agg_mode: str = field(
        "token_mean", "Loss aggregation over the global batch.", choices=("token_mean", "seq_mean")
    )
    use_sapo_loss: bool = field(
        False,
        "SAPO (arXiv 2511.20347): soft sigmoid gates on the ratio instead of PPO's clip; needs use_decoupled_loss: false.",
    )
    sapo_tau_pos: float = field(
        1.0, "SAPO's gate temperature for tokens with a positive advantage.", gt=0
    )
    sapo_tau_neg: float = field(
        1.05, "SAPO's gate temperature for tokens with a negative or zero advantage.", gt=0
    )
    m2_threshold: float | None = field(
        None,
        "M2PO (arXiv 2510.01161): drop the tokens with the largest (log proximal/behaviour)^2 until the mean over the minibatch's kept tokens is below this; null disables.",
        gt=0,
    )
    beta: float = field(
        0.1,
        "DPO (algorithm: dpo): the strength of the implicit KL to the reference model; the implicit reward is beta * (log pi - log pi_ref).",
        gt=0,
    )
    loss_type: str = field(
        "sigmoid",
        "DPO's loss: sigmoid (the paper's -log sigmoid of the reward margin) or ipo (Azar et al. 2023: squared distance of the per-token log-ratio margin from 1 / (2 beta)).",
        choices=("sigmoid", "ipo"),
    )
    use_lora: bool = field(
        False,
        "Train LoRA adapters on a frozen base model: only the adapters get gradients and optimizer state, and only they travel to the servers (PEFT's folder layout).",
    )
    peft_type: str = field(
        "lora", "The adapter kind (AReaL's name); lora is the one built.", choices=("lora",)
    )
    lora_rank: int = field(32, "Rank r of each LoRA adapter.", ge=1)
    lora_alpha: float = field(
        16.0, "LoRA alpha: the update is scaled by lora_alpha / lora_rank.", gt=0
    )
    target_modules: list[str] = field(
        factory=lambda: ["all-linear"],
        doc="Linear layers that get adapters: all-linear (every one but the output head), or module-name suffixes such as q_proj, v_proj (PEFT's matching).",
    )

    def rejection(self) -> RejectionSamplingConfig:
        """The filter in force: behav_imp_weight_cap, the short form, when it is set
        (the rules refuse it beside rejection_sampling keys), else rejection_sampling."""
        if self.behav_imp_weight_cap is not None:
            return RejectionSamplingConfig(upper=self.behav_imp_weight_cap)
        return self.rejection_sampling


@dataclass
class TrainerConfig:
    """The torchrun trainer processes (how they run; what they learn is under actor)."""

    collective_timeout_s: float = field(
        600.0,
        "Timeout of every collective of the trainer's process group; a rank left waiting longer fails with an error instead of hanging.",
        gt=0,
    )


@dataclass
class ParallelStrategy:
    """One side of an allocation: data, tensor, pipeline and context parallel sizes."""

    data_parallel_size: int = field(1, "Data-parallel replicas (d).", ge=1)
    tensor_parallel_size: int = field(1, "Tensor-parallel size (t).", ge=1)
    pipeline_parallel_size: int = field(1, "Pipeline stages (p).", ge=1)
    context_parallel_size: int = field(1, "Context-parallel size (c).", ge=1)

    @property
    def world_size(self) -> int:
        """Devices (or ranks) this side needs."""
        return (
            self.data_parallel_size
            * self.tensor_parallel_size
            * self.pipeline_parallel_size
            * self.context_parallel_size
        )

    @property
    def per_replica_size(self) -> int:
        """Devices used by one data-parallel replica (one inference server)."""
        return self.world_size // self.data_parallel_size


@dataclass
class ProxyConfig:
    """The agent proxy (rollout.agent): OpenAI routes in front of the servers."""

    host: str = field(
        "127.0.0.1",
        "Address the proxy binds; anything but loopback needs inference.api_key, which then guards every route.",
    )
    port: int = field(0, "Port of the proxy; 0 picks a free one.", ge=0, le=65535)
    admin_api_key: str = field(
        "",
        "rollout.mode online: the key POST /rl/start_session needs (AReaL's admin_api_key); each session then gets a key of its own. Required when the proxy binds beyond loopback; empty on loopback lets any local process start sessions.",
    )


@dataclass
class RolloutConfig:
    """The asynchronous rollout loop."""

    batch_size: int = field(8, "Prompts per trainer step.", ge=1)
    group_size: int = field(4, "Samples drawn per prompt (the GRPO group).", ge=1)
    max_staleness: int = field(
        1,
        "A sample started under weight version v may train step s only if s - v <= max_staleness; 0 is synchronous RL.",
        ge=0,
        fix="use 0 for synchronous RL or a small positive integer such as 2",
    )
    max_concurrent_rollouts: int | None = field(
        None,
        "Prompts (groups) in flight at once; null means batch_size * (max_staleness + 1).",
        ge=1,
    )
    workflow: str = field(
        "single_turn",
        "Episode workflow: single_turn, multi_turn, or module:function (an async run_episode beside the recipe).",
    )
    max_turns: int = field(2, "Turns per episode for the multi_turn workflow.", ge=1)
    mode: str = field(
        "inline",
        "Who runs the episodes (AReaL's rollout.agent.mode): inline (the workflow, or rollout.agent, in the controller's event loop), subproc (rollout.agent in subproc_max_workers worker processes: a synchronous or blocking agent cannot stall the loop) or online (an outside application drives sessions through the agent proxy's /rl routes).",
        choices=("inline", "subproc", "online"),
    )
    subproc_max_workers: int = field(
        4, "rollout.mode subproc: worker processes, each running one agent episode at a time.", ge=1
    )
    session_timeout_s: float = field(
        3600.0,
        "rollout.mode online: a session idle this long (no request of its own being handled, none arriving or answered since) is ended, counted as online_timeouts and not trained on; a started group whose sessions stop coming closes after this long with those it has.",
        gt=0,
    )
    agent: str = field(
        "",
        "An agent written against the OpenAI SDK, as module:Name beside the recipe: a class with async run(self, data, **kwargs), or an async function (data, **kwargs). It gets the dataset row and base_url, api_key and http_client for the run's agent proxy, and returns a float reward or a dict of completion id to reward. Empty: the workflow runs episodes.",
    )
    agent_timeout_s: float = field(
        600.0,
        "An agent episode running longer is cancelled, counted as agent_timeouts, and dropped.",
        gt=0,
    )
    agent_samples: str = field(
        "concat",
        "How an agent's completions become training samples: concat (turns that extend one another's tokens join into one sequence, loss on the generated tokens only) or individual (one sample per completion).",
        choices=("concat", "individual"),
    )
    turn_discount: float = field(
        1.0,
        "Each completion that the agent's reward does not name gets the reward of the one after it times this (the last gets the episode's reward).",
        gt=0,
        le=1,
    )
    tool_parser: str = field(
        "auto",
        "How the agent proxy reads tool calls from replies: auto (from the chat template), hermes (<tool_call>{json}</tool_call>), llama3 (a JSON object) or none.",
        choices=("auto", "hermes", "llama3", "none"),
    )
    proxy: ProxyConfig = sub(ProxyConfig)
    request_timeout_s: float = field(600.0, "Timeout of one /generate request.", gt=0)
    request_retries: int = field(3, "Retries of a failed request before the run fails.", ge=0)
    dynamic_sampling: bool = field(
        False,
        "Drop every group whose rewards are all equal (DAPO's dynamic sampling): with a group baseline its advantages are 0. Counted as dropped_uniform.",
    )
    dynamic_bs: bool = field(
        False,
        "With dynamic_sampling: write a batch once batch_size groups finished since the last one, dropped or kept, with the kept ones (a smaller batch); false refills the batch to batch_size.",
    )
    dynamic_max_batches: int = field(
        10,
        "With dynamic_sampling: once this many batches' worth of groups were dropped for one batch, it is written with the groups kept so far, and with none the run stops with a named error.",
        ge=1,
    )


@dataclass
class GenerationHyperparameters:
    """Sampling settings sent with every /generate request (SGLang sampling_params)."""

    max_new_tokens: int = field(256, "Maximum tokens generated per sample.", ge=1)
    temperature: float = field(
        1.0,
        "Sampling temperature; 0 means greedy. The trainer computes logprobs at the same temperature.",
        ge=0,
    )
    top_p: float = field(1.0, "Nucleus sampling mass.", gt=0, le=1)
    top_k: int = field(-1, "Top-k sampling; -1 disables.", ge=-1)
    stop_token_ids: list[int] = field(
        factory=list, doc="Extra token ids that end a sample (EOS always does)."
    )
    ignore_eos: bool = field(False, "Keep generating past EOS until max_new_tokens.")
    lora_name: str = field(
        "",
        "Name of the LoRA adapter the servers serve (actor.use_lora); each version loads as NAME-vK. Empty: the experiment name.",
    )

    def sampling_params(self) -> dict:
        """These settings as an SGLang `sampling_params` body (no per-request seed)."""
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass
class DatasetConfig:
    """Where prompts and reference answers come from."""

    path: str = field(
        "",
        "A .jsonl or .parquet file, or a Hub dataset name already in the local cache.",
        path=True,
    )
    type: str = field(
        "auto",
        "Format: auto (from the extension), jsonl, parquet or hub.",
        choices=("auto", "jsonl", "parquet", "hub"),
    )
    split: str = field("train", "Split to read (Hub datasets).")
    prompt_key: str = field("prompt", "Column holding the prompt text.")
    answer_key: str = field("answer", "Column holding the reference answer given to the reward.")
    max_prompt_len: int = field(
        1024, "Prompts longer than this many tokens are bad rows (see on_bad_row).", ge=1
    )
    on_bad_row: str = field(
        "skip",
        "Rows that cannot be used (a JSONL line that is not UTF-8 or JSON, a missing or wrong-typed prompt or answer, a prompt over max_prompt_len): skip them with one warning line per kind, or error: stop before any process starts.",
        choices=("skip", "error"),
    )
    apply_chat_template: bool = field(True, "Format prompts with the tokenizer's chat template.")
    system_prompt: str = field("", "Optional system message put before every prompt.")
    shuffle: bool = field(True, "Shuffle the dataset (with `seed`) at the start of each epoch.")
    seed: int = field(1, "Shuffle seed.", ge=0)


@dataclass
class TeacherConfig:
    """On-policy distillation (AReaL's teacher section): a frozen teacher in the trainer
    ranks, sharded like the reference model, scores every rollout token; the loss adds the
    student's reverse KL to it (areal_cli.trainer.step)."""

    path: str = field(
        "",
        "The teacher: an HF causal-LM folder (a checkpoint of another run, say) or builtin:NAME, sharing the student's tokenizer; empty: no distillation.",
        path=True,
    )
    rl_loss_weight: float = field(
        1.0, "Weight of the RL (PPO/GRPO) loss; 0: pure distillation.", ge=0
    )
    distill_loss_weight: float = field(0.005, "Weight of the reverse-KL distillation loss.", ge=0)


@dataclass
class RewardConfig:
    """How samples are scored."""

    fn: str = field(
        "builtin:exact_match",
        "builtin:exact_match, builtin:numeric, builtin:math (math-verify), module:function beside the recipe, or model:PATH, a reward model trained with algorithm: rm (it scores prompt and completion tokens, batched; relative to the recipe).",
    )
    timeout_s: float = field(
        10.0,
        "A reward call that takes longer scores 0 (counted in metrics); for model:PATH, one batch of calls.",
        gt=0,
    )
    num_workers: int = field(1, "Worker processes that compute rewards.", ge=1)


@dataclass
class EmbeddedServerConfig:
    """The embedded inference server (torch + transformers, CPU or CUDA)."""

    dtype: str = field("float32", "Dtype the server runs the model in.", choices=DTYPES)
    max_running_requests: int = field(
        64, "Requests decoded together in one continuous batch.", ge=1
    )
    device: str = field(
        "auto", "auto (CUDA when present), cpu or cuda.", choices=("auto", "cpu", "cuda")
    )
    context_length: int | None = field(
        None,
        "Longest prompt plus reply in tokens; null: the model's max_position_embeddings.",
        ge=1,
    )
    disable_cuda_graph: bool = field(
        False,
        "Decode without CUDA graphs on a GPU (each step then launches its kernels one by one; "
        "a CPU never captures graphs).",
    )
    cuda_graph_max_bs: int | None = field(
        None, "Largest batch a decode graph is captured for; null: max_running_requests.", ge=1
    )


@dataclass
class SGLangConfig:
    """Arguments of `python -m sglang.launch_server` (names as in SGLang's server_args.py)."""

    dtype: str = field("bfloat16", "--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    mem_fraction_static: float = field(
        0.8, "--mem-fraction-static: GPU memory fraction for weights and KV cache.", gt=0, le=1
    )
    context_length: int | None = field(None, "--context-length; null uses the model's.", ge=1)
    max_running_requests: int | None = field(
        None, "--max-running-requests; null lets SGLang decide.", ge=1
    )
    chunked_prefill_size: int | None = field(
        None, "--chunked-prefill-size; null lets SGLang decide."
    )
    attention_backend: str | None = field(
        None, "--attention-backend (e.g. fa3, flashinfer, triton); null lets SGLang decide."
    )
    disable_radix_cache: bool = field(False, "--disable-radix-cache")
    disable_cuda_graph: bool = field(
        False, "--disable-decode-cuda-graph (--disable-cuda-graph before sglang 0.5.23)."
    )
    cuda_graph_max_bs: int | None = field(
        None,
        "--cuda-graph-max-bs-decode (--cuda-graph-max-bs before sglang 0.5.23); null lets "
        "SGLang decide.",
        ge=1,
    )
    enable_deterministic_inference: bool = field(False, "--enable-deterministic-inference")
    random_seed: int | None = field(None, "--random-seed")
    schedule_policy: str = field(
        "lpm",
        "--schedule-policy",
        choices=("lpm", "random", "fcfs", "dfs-weight", "lof", "priority"),
    )
    log_level: str = field("warning", "--log-level", choices=("debug", "info", "warning", "error"))
    enable_metrics: bool = field(False, "--enable-metrics")
    skip_server_warmup: bool = field(False, "--skip-server-warmup")
    trust_remote_code: bool = field(False, "--trust-remote-code")


@dataclass
class VLLMConfig:
    """Arguments of vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`)."""

    python: str = field(
        "",
        "Interpreter that runs vLLM's server; empty: the one running areal. `make vllm` "
        "installs vLLM into .venv-vllm, apart from areal's own pins: set "
        ".venv-vllm/bin/python (relative paths are from the working directory).",
    )
    dtype: str = field(
        "auto",
        "--dtype; auto: model.dtype, like the trainer (vLLM's own auto picks bfloat16 on a "
        "CPU that has it, even for a float32 model).",
        choices=("auto", *DTYPES),
    )
    max_model_len: int | None = field(None, "--max-model-len; null uses the model's.", ge=1)
    max_num_seqs: int | None = field(
        None, "--max-num-seqs: requests decoded together; null lets vLLM decide.", ge=1
    )
    gpu_memory_utilization: float = field(0.8, "--gpu-memory-utilization (GPU only).", gt=0, le=1)
    kv_cache_space_gib: int = field(
        2, "KV cache size on a CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).", ge=1
    )
    enforce_eager: bool | None = field(
        None,
        "--enforce-eager; null: on a CPU (vLLM's torch.compile warm-up adds ~45 s to startup "
        "on 2 cores), not on GPUs (CUDA graphs).",
    )
    enable_prefix_caching: bool = field(
        False,
        "--enable-prefix-caching (else --no-...). Off by default: with it on, each weight "
        "update restarts the requests in flight from their prompts (vLLM cannot drop a "
        "cache they hold); off, they continue on the new weights.",
    )
    seed: int | None = field(None, "--seed; null: the recipe's seed plus the server index.")
    enable_chunked_prefill: bool | None = field(
        None,
        "--enable-chunked-prefill (else --no-...); null: off on a CPU, where a prompt "
        "prefilled in chunks makes vLLM rewind a seeded request's generator, which a CPU "
        "generator cannot (the worker dies: 'CPU Generator does not use offset'); vLLM's "
        "default on GPUs.",
    )


@dataclass
class InferenceConfig:
    """Inference servers. The backend itself is chosen by allocation_mode."""

    api_key: str = field(
        "", "When set, servers require this bearer token on every route but /health."
    )
    embedded: EmbeddedServerConfig = sub(EmbeddedServerConfig)
    sglang: SGLangConfig = sub(SGLangConfig)
    vllm: VLLMConfig = sub(VLLMConfig)


@dataclass
class SaverConfig:
    """Hugging Face checkpoints kept under RUN/checkpoints/."""

    freq_steps: int = field(0, "Save every this many steps; 0 saves only at the end.", ge=0)
    keep_last: int = field(1, "Keep this many saved checkpoints.", ge=1)


@dataclass
class RecoverConfig:
    """DCP recover checkpoints used by `areal train --resume`."""

    freq_steps: int = field(
        1, "Write a recover checkpoint every this many steps; 0 disables.", ge=0
    )
    keep_last: int = field(1, "Keep this many recover checkpoints.", ge=1)


@dataclass
class EvalConfig:
    """Evaluation: `areal eval`, and during training every `freq_steps` steps on the run's
    servers (eval rows in metrics.jsonl): dataset (or a held-out part of the training
    data), reward, sampling, samples and pass@k."""

    dataset: DatasetConfig = sub(DatasetConfig)
    reward: RewardConfig = sub(RewardConfig)
    gconfig: GenerationHyperparameters = sub(GenerationHyperparameters)
    n_samples: int = field(1, "Samples per prompt.", ge=1)
    k: list[int] = field(
        factory=lambda: [1], doc="Values of k for pass@k; each must be <= n_samples."
    )
    max_prompts: int = field(0, "Evaluate only the first N prompts; 0 means all.", ge=0)
    seed: int = field(1, "Sampling seed; results are deterministic for a fixed seed.", ge=0)
    freq_steps: int = field(
        0,
        "During training (grpo, ppo): evaluate on the run's servers each time they hold weights vK with K a multiple of this, and write an eval row to metrics.jsonl; 0: never. For sft and rm: how often the held-out loss runs (in place of ROLE.eval_freq_steps).",
        ge=0,
    )
    holdout: int = field(
        0,
        "With eval.dataset.path empty: hold this many training prompts out (drawn with dataset.seed) as the evaluation set; they are never trained on.",
        ge=0,
    )


@dataclass
class WandbConfig:
    """Weights & Biases logging (optional)."""

    mode: str = field(
        "disabled", "disabled, online or offline.", choices=("disabled", "online", "offline")
    )
    project: str = field("areal", "wandb project.")
    entity: str = field("", "wandb entity (team); empty uses your default.")


@dataclass
class LoggingConfig:
    """Metrics and console output."""

    level: str = field(
        "info", "Log level of areal's own processes.", choices=("debug", "info", "warning", "error")
    )
    display: str = field(
        "auto",
        "auto (rich live view on a terminal, plain lines otherwise), rich or plain.",
        choices=("auto", "rich", "plain"),
    )
    tensorboard: bool = field(True, "Also write TensorBoard event files under RUN/tensorboard/.")
    wandb: WandbConfig = sub(WandbConfig)


@dataclass
class ExperimentConfig:
    """A whole recipe."""

    experiment_name: str = field(
        "", "Name of the experiment; the run lives in FILEROOT/EXPERIMENT/TRIAL/."
    )
    trial_name: str = field("trial0", "Name of this trial of the experiment.")
    allocation_mode: str = field(
        "", "Devices per component, e.g. sglang:d4t1+fsdp:d4 or embedded:d1+fsdp:d2."
    )
    algorithm: str = field(
        "grpo",
        "What to train: grpo (RL: inference servers, rollouts, the actor's PPO loss with group advantages), ppo (the same with a critic and GAE), sft (supervised on dataset answers), rm (a reward model on preference pairs) or dpo (direct preference optimization on those pairs, against a frozen reference); sft, rm and dpo start no inference server.",
        choices=ALGORITHMS,
    )
    seed: int = field(1, "Global seed of the trainer and the rollout loop.", ge=0)
    total_train_steps: int = field(100, "Trainer steps to run.", ge=1)
    cluster: ClusterSpecConfig = sub(ClusterSpecConfig)
    launcher: LauncherConfig = sub(LauncherConfig)
    model: ModelConfig = sub(ModelConfig)
    actor: TrainEngineConfig = sub(TrainEngineConfig)
    trainer: TrainerConfig = sub(TrainerConfig)
    sft: SFTConfig = sub(SFTConfig)
    rm: RMConfig = sub(RMConfig)
    dpo: DPOConfig = sub(DPOConfig)
    critic: CriticConfig = sub(CriticConfig)
    rollout: RolloutConfig = sub(RolloutConfig)
    gconfig: GenerationHyperparameters = sub(GenerationHyperparameters)
    dataset: DatasetConfig = sub(DatasetConfig)
    reward: RewardConfig = sub(RewardConfig)
    teacher: TeacherConfig = sub(TeacherConfig)
    inference: InferenceConfig = sub(InferenceConfig)
    saver: SaverConfig = sub(SaverConfig)
    recover: RecoverConfig = sub(RecoverConfig)
    eval: EvalConfig = sub(EvalConfig)
    logging: LoggingConfig = sub(LoggingConfig)

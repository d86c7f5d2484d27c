"""The RL algorithm's own keys (grpo, ppo): rollout sizes and staleness, the reward and
workflow functions, the eval section, and the weight-update method."""

from __future__ import annotations

from areal_cli.config.checker import Checker
from areal_cli.config.recipe_code import agent_problem, spec_problem
from areal_cli.config.resolve import is_loopback
from areal_cli.config.rules.paths import check_dataset, check_teacher

BUILTIN_REWARDS = ("exact_match", "numeric", "math")
BUILTIN_WORKFLOWS = ("single_turn", "multi_turn")


def check_rl(c: Checker, command: str, launch: bool) -> None:
    """The rules of the RL algorithm's own keys: rollout, reward, workflow, eval."""
    _check_rollout(c)
    if command in ("train", "validate"):
        _check_callable(c, "reward.fn", c.cfg.reward.fn, BUILTIN_REWARDS, launch=launch)
        _check_callable(
            c, "rollout.workflow", c.cfg.rollout.workflow, BUILTIN_WORKFLOWS, builtin_prefix=False
        )
        _check_agent(c)
        if c.valid("teacher", "model.path"):
            check_teacher(c, launch)
    if (command == "eval" or c.cfg.eval.dataset.path) and c.valid("eval.dataset"):
        check_dataset(
            c, "eval.dataset", c.cfg.eval.dataset.path, launch, required=command == "eval"
        )
        _check_callable(c, "eval.reward.fn", c.cfg.eval.reward.fn, BUILTIN_REWARDS, launch=launch)
    _check_eval(c)


def _check_norms(c: Checker) -> None:
    """reward_norm and adv_norm are read with adv_estimator: custom only (the named
    estimators are presets of them); a group mean over groups of one is always the value."""
    actor = c.cfg.actor
    if not c.valid("actor.adv_estimator"):
        return
    for name in ("reward_norm", "adv_norm"):
        if actor.adv_estimator != "custom" and ("actor", name) in c.loaded.locations:
            c.error(
                f"actor.{name}",
                f"is only read with actor.adv_estimator: custom (adv_estimator {actor.adv_estimator} is a preset of reward_norm)",
                "set actor.adv_estimator: custom, or remove it",
            )
    norm = actor.reward_norm
    if (
        actor.adv_estimator == "custom"
        and c.valid("rollout.group_size", "actor.reward_norm.mean_level")
        and norm.mean_level == "group"
        and not norm.mean_leave1out
        and c.cfg.rollout.group_size < 2
    ):
        c.error(
            "rollout.group_size",
            "reward_norm subtracts the group mean; with group_size 1 every advantage is zero",
            "set rollout.group_size >= 2",
        )


def _check_overlong(c: Checker) -> None:
    """The overlong penalty's window lies inside max_new_tokens."""
    actor, limit = c.cfg.actor, c.cfg.gconfig.max_new_tokens
    keys = ("actor.overlong_tokens", "gconfig.max_new_tokens")
    if not actor.overlong_reward_penalty or not c.valid(*keys):
        return
    if not 0 < actor.overlong_tokens <= limit:
        c.error(
            "actor.overlong_tokens",
            f"{actor.overlong_tokens} must be between 1 and gconfig.max_new_tokens ({limit}) with overlong_reward_penalty",
            f"set it to the last stretch of the {limit} new tokens that is penalised, e.g. {max(1, limit // 4)}",
        )


def _check_dynamic_sampling(c: Checker) -> None:
    """dynamic_bs is a mode of dynamic_sampling; a group of one always has equal rewards."""
    rollout = c.cfg.rollout
    if not c.valid("rollout.dynamic_sampling", "rollout.dynamic_bs", "rollout.group_size"):
        return
    if rollout.dynamic_bs and not rollout.dynamic_sampling:
        c.error(
            "rollout.dynamic_bs",
            "is a mode of dynamic sampling, which is off: no group is dropped, so every batch is full",
            "set rollout.dynamic_sampling: true, or remove rollout.dynamic_bs",
        )
    if rollout.dynamic_sampling and rollout.group_size < 2:
        c.error(
            "rollout.dynamic_sampling",
            "drops groups whose rewards are all equal, and a group of one sample always is",
            "set rollout.group_size >= 2, or dynamic_sampling: false",
        )


def _check_sequence_ratio(c: Checker) -> None:
    """GSPO's sequence ratio needs each sequence whole on one rank."""
    mode = c.result.allocation  # parsed by the allocation rules, None when it is bad
    if c.cfg.actor.importance_sampling_level != "sequence" or mode is None:
        return
    if mode.train is not None and mode.train.context_parallel_size > 1:
        c.error(
            "actor.importance_sampling_level",
            "sequence (GSPO) needs each sequence on one rank, but the allocation splits them over context-parallel ranks",
            f"drop c from '{c.cfg.allocation_mode}', or use importance_sampling_level: token",
        )


def _check_sapo(c: Checker) -> None:
    """SAPO's gates replace the decoupled objective's clip and weight, as in AReaL, which
    refuses the two together; PPO's clip keys then do nothing."""
    a = c.cfg.actor
    if not a.use_sapo_loss:
        return
    if a.use_decoupled_loss:
        c.error(
            "actor.use_sapo_loss",
            "SAPO is not built with the decoupled PPO objective (actor.use_decoupled_loss: true, the default)",
            "set actor.use_decoupled_loss: false",
        )
    for key in ("eps_clip", "eps_clip_higher", "c_clip"):
        if ("actor", key) in c.loaded.locations:
            c.warn(f"actor.{key}", "is not read by SAPO (actor.use_sapo_loss)", "remove it")


def _check_decoupled(c: Checker) -> None:
    """rejection_sampling (or its short form behav_imp_weight_cap) and prox_logp_method
    belong to the decoupled objective; their bounds must be able to keep a token."""
    a, loaded = c.cfg.actor, c.loaded.locations
    given = [
        k
        for k in ("behav_imp_weight_cap", "rejection_sampling", "prox_logp_method")
        if any(p[:2] == ("actor", k) for p in loaded)
    ]
    if not a.use_decoupled_loss:
        for key in given:
            c.warn(
                f"actor.{key}",
                "is only read by the decoupled objective (actor.use_decoupled_loss: false)",
                "remove it",
            )
        return
    if ("actor", "behav_imp_weight_cap") in loaded:
        if a.behav_imp_weight_cap is None:
            c.error(
                "actor.behav_imp_weight_cap",
                "null no longer turns the filter off: the default actor.rejection_sampling (ratio above 5.0 dropped) applies",
                "write actor.rejection_sampling.upper: null to turn it off, or give a cap",
            )
        elif "rejection_sampling" in given:
            c.error(
                "actor.behav_imp_weight_cap",
                "is the short form of actor.rejection_sampling, and both are set",
                "keep one: rejection_sampling.upper is the cap",
            )
    _check_prox_method(c)
    if c.valid("actor.rejection_sampling"):
        _check_rejection(c, "rejection_sampling" in given)


def _check_rejection(c: Checker, full_form: bool) -> None:
    """The filter's bounds must be able to keep a token; clamp bounds a ratio."""
    rs = c.cfg.actor.rejection()
    where = "actor.rejection_sampling" if full_form else "actor.behav_imp_weight_cap"
    if rs.lower is not None and rs.upper is not None and rs.lower > rs.upper:
        c.error(
            f"{where}.lower",
            f"{rs.lower} is above upper {rs.upper}: every token is out of bounds",
            "lower it below upper",
        )
    if rs.metric == "ratio":
        if rs.upper is not None and rs.upper <= 1:
            c.error(
                where,
                f"upper {rs.upper} is not above 1, so every token the policy has moved on is dropped",
                "use an upper bound above 1, e.g. 2.0 or 5.0",
            )
        if rs.lower is not None and not 0 < rs.lower < 1:
            c.error(
                f"{where}.lower",
                f"{rs.lower} must lie between 0 and 1 for the ratio",
                "use e.g. 0.5, or null",
            )
    elif rs.action == "clamp":
        c.error(
            f"{where}.action",
            f"clamp bounds the importance ratio, but metric is {rs.metric}",
            "use metric: ratio with clamp, or action: mask",
        )
    mode = c.result.allocation
    if (
        rs.level == "sequence"
        and mode is not None
        and mode.train is not None
        and mode.train.context_parallel_size > 1
    ):
        c.error(
            f"{where}.level",
            "sequence needs each sequence on one rank, but the allocation splits them over context-parallel ranks",
            f"drop c from '{c.cfg.allocation_mode}', or use level: token",
        )


def _check_prox_method(c: Checker) -> None:
    """prox_logp_method only matters where a proximal pass would run."""
    a = c.cfg.actor
    if (
        a.prox_logp_method == "loglinear"
        and c.valid("actor.ppo_n_minibatches")
        and a.ppo_n_minibatches == 1
    ):
        c.warn(
            "actor.prox_logp_method",
            "loglinear changes nothing with ppo_n_minibatches 1: the training forward runs on the proximal weights, so areal has their logprobs exactly and free",
            "remove it, or raise ppo_n_minibatches",
        )
    if a.prox_logp_method != "recompute" and a.m2_threshold is not None:
        c.warn(
            "actor.prox_logp_method",
            "M2PO (actor.m2_threshold) filters on the recomputed proximal logprobs, so the proximal pass still runs",
            "remove m2_threshold to skip the pass",
        )


def _check_rollout(c: Checker) -> None:
    actor = c.cfg.actor
    _check_rollout_sizes(c)
    _check_sequence_ratio(c)
    _check_sapo(c)
    _check_decoupled(c)
    _check_norms(c)
    _check_overlong(c)
    _check_dynamic_sampling(c)
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


def _check_callable(
    c: Checker,
    key: str,
    spec: str,
    builtins: tuple[str, ...],
    builtin_prefix: bool = True,
    launch: bool = True,
) -> bool:
    """A reward, workflow or agent spec (see recipe_code.spec_problem); whether it passed."""
    if not c.valid(key):
        return False
    found = spec_problem(spec, builtins, c.loaded.recipe.resolve().parent, builtin_prefix, launch)
    if found is not None:
        message, fix, only_warn = found
        (c.warn if only_warn else c.error)(key, message, fix)
    return found is None


def _check_agent(c: Checker) -> None:
    """rollout.agent runs the episodes and returns their rewards: it replaces the workflow
    and the reward function; rollout.mode says where it runs, and online mode has none
    (an outside application drives the sessions). A proxy beyond loopback needs a key."""
    rollout = c.cfg.rollout
    if not c.valid("rollout.agent", "rollout.proxy.host", "rollout.mode"):
        return
    if rollout.mode == "online":
        _check_online(c)
        return
    if rollout.mode == "subproc" and not rollout.agent:
        c.error(
            "rollout.mode",
            "subproc runs rollout.agent in worker processes, and no agent is set",
            "set rollout.agent: module:Name, or rollout.mode: inline",
        )
    if not rollout.agent:
        return
    if _check_callable(c, "rollout.agent", rollout.agent, (), builtin_prefix=False):
        # the file is there, parses and defines the name: load it and check its contract
        problem = agent_problem(
            rollout.agent, c.loaded.recipe.resolve().parent, sync_ok=rollout.mode == "subproc"
        )
        if problem is not None:
            c.error("rollout.agent", problem, "fix the agent so that it loads")
    _not_read(
        c,
        ("rollout.workflow", "reward.fn"),
        "with rollout.agent: the agent runs each episode and returns its reward",
        "rollout.agent",
    )
    host = rollout.proxy.host
    if not is_loopback(host) and not c.cfg.inference.api_key:
        c.error(
            "rollout.proxy.host",
            f"{host} is beyond loopback, and the agent proxy would answer anyone without a key",
            "set inference.api_key (the proxy then needs it), or host: 127.0.0.1",
        )


def _not_read(c: Checker, keys: tuple[str, ...], why: str, instead: str) -> None:
    for key in keys:
        if tuple(key.split(".")) in c.loaded.locations:
            c.error(key, f"is not read {why}", f"remove {key}, or {instead}")


def _online(c: Checker) -> bool:
    return c.valid("rollout.mode") and c.cfg.rollout.mode == "online"


def _check_online(c: Checker) -> None:
    """rollout.mode online: an outside application is the agent (it sets the rewards);
    sessions need their own keys, and start_session the admin key beyond loopback."""
    rollout = c.cfg.rollout
    why = (
        "with rollout.mode online: the outside application drives each session and sets its reward"
    )
    _not_read(c, ("rollout.agent", "rollout.workflow", "reward.fn"), why, "rollout.mode")
    if c.cfg.dataset.path:
        c.warn(
            "dataset.path",
            "is not read with rollout.mode online: the sessions bring their own prompts",
            "remove it (eval.dataset still gives held-out evaluation)",
        )
    ev = c.cfg.eval
    if c.valid("eval.freq_steps", "eval.dataset") and ev.freq_steps and not ev.dataset.path:
        c.error(
            "eval.freq_steps",
            "with rollout.mode online needs eval.dataset.path: there is no dataset to hold out from",
            "set eval.dataset.path, or eval.freq_steps: 0",
        )
    host = rollout.proxy.host
    if not is_loopback(host) and not rollout.proxy.admin_api_key:
        c.error(
            "rollout.proxy.host",
            f"{host} is beyond loopback, and anyone who reaches it could start sessions",
            "set rollout.proxy.admin_api_key (POST /rl/start_session then needs it), or host: 127.0.0.1",
        )


def _check_eval(c: Checker) -> None:
    _check_eval_during_training(c)
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


def _check_eval_during_training(c: Checker) -> None:
    """eval.freq_steps needs prompts: eval.dataset, or eval.holdout, not both."""
    if not c.valid("eval.freq_steps", "eval.holdout", "eval.dataset"):
        return
    ev = c.cfg.eval
    if ev.holdout and ev.dataset.path:
        c.error(
            "eval.holdout",
            f"holds {ev.holdout} training prompts out, but eval.dataset.path ({ev.dataset.path}) already gives the eval prompts",
            "remove one of them",
        )
    elif ev.freq_steps and not ev.dataset.path and not ev.holdout and not _online(c):
        c.error(
            "eval.freq_steps",
            "evaluates during training, but there are no eval prompts",
            "set eval.dataset.path, or eval.holdout: N to hold N training prompts out",
        )
    elif ev.holdout and not ev.freq_steps:
        c.warn(
            "eval.holdout",
            f"holds {ev.holdout} prompts out of training, but eval.freq_steps is 0, so they are never evaluated",
            "set eval.freq_steps, or eval.holdout: 0",
        )

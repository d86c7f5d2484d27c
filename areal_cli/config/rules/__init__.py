"""Cross-field checks of a loaded recipe: every rule, in one package, run by `check_config`.

`check_config` runs every rule on the resolved config (config.resolve) and returns all
problems and warnings together; a rule that would read a key the loader already found
invalid is skipped, so each independent problem is reported once. Static rules
(divisibility, allocation against the declared cluster, paths that look local) run for
`validate` and `--dry-run`; `launch=True` adds what only a real run needs (model weights
and datasets present on this machine), so a dry run of a GPU recipe works on a laptop.

Each module holds the rules of one part of the recipe, and every rule writes into the
public `Checker` (config.checker). What an inference backend needs beyond the allocation
(vLLM's interpreter) is that backend's own rule (inference.backends: `check`), which the
caller passes in as `backends`, since config sits below inference:
  allocation  the allocation string (parsed here, once), devices, ports, batch, t/c
  paths       the model, its tokenizer and the datasets on this machine
  rl          rollout, staleness, reward and workflow functions, eval, weight update
  roles       the sections and keys of each algorithm; the reward model and the critic
  lora        actor.use_lora: the role, layout, weight update and targets it is built for
  launcher    several nodes; Slurm's options
  run_dir     the run's names and a writable fileroot
"""

from __future__ import annotations

from collections.abc import Callable

from areal_cli.config.checker import BackendRules, Checker, CheckResult
from areal_cli.config.errors import ConfigErrors
from areal_cli.config.loader import LoadedConfig
from areal_cli.config.rules.allocation import (
    check_allocation,
    check_batch,
    check_colocated,
    check_devices,
    check_ports,
    check_tensor_parallel,
)
from areal_cli.config.rules.launcher import check_slurm
from areal_cli.config.rules.lora import check_lora
from areal_cli.config.rules.paths import check_dataset, check_model
from areal_cli.config.rules.rl import check_rl
from areal_cli.config.rules.roles import (
    check_critic,
    check_dpo,
    check_reward_model,
    check_role_keys,
    check_role_sections,
)
from areal_cli.config.rules.run_dir import check_fileroot, check_names
from areal_cli.config.schema import SUPERVISED

__all__ = ["CheckResult", "Checker", "check_config", "raise_on_problems"]


def check_config(
    loaded: LoadedConfig,
    *,
    command: str = "train",
    launch: bool = False,
    invalid: frozenset[str] = frozenset(),
    backends: Callable[[str], BackendRules] | None = None,
) -> CheckResult:
    """Run every cross-field rule; `command` is train, eval or validate. Rules that read a
    key in `invalid` (already reported by the loader) are skipped. `backends(name)` gives
    the inference backend's own rules (areal_cli.inference.backends.backend_for)."""
    c = Checker(loaded, invalid)
    check_names(c)
    supervised = c.cfg.algorithm in SUPERVISED and command != "eval"
    check_role_sections(c)
    if supervised:
        check_role_keys(c)
    mode = check_allocation(c, command, supervised) if c.valid("allocation_mode") else None
    c.result.allocation = mode
    if mode is not None:
        if backends is not None and mode.inference_backend is not None:
            backends(mode.inference_backend).check(c, launch)
        check_devices(c, mode)
        if mode.colocated:
            check_colocated(c, mode)
        check_ports(c, mode)
        if mode.train is not None and not supervised:
            check_batch(c, mode)
    if c.valid("model"):
        check_model(c, launch)
        if mode is not None and mode.train is not None and c.valid("allocation_mode"):
            check_tensor_parallel(c, mode)
    if command in ("train", "validate") and c.valid("dataset"):
        online = not supervised and c.cfg.rollout.mode == "online"  # sessions bring their data
        check_dataset(c, "dataset", c.cfg.dataset.path, launch, required=not online)
    if supervised:
        role = c.cfg.algorithm
        own, shared = getattr(c.cfg, role).eval_path, c.cfg.eval.dataset.path
        if own and shared:
            c.error(
                "eval.dataset.path",
                f"and {role}.eval_path ({own}) both give the held-out rows",
                "keep one of them",
            )
        key = f"{role}.eval_path" if own else "eval.dataset.path"
        if c.valid(key) and (own or shared):
            check_dataset(c, key, own or shared, launch, required=False)
        if role == "rm":
            check_reward_model(c, mode)
    else:
        check_rl(c, command, launch)
        if c.cfg.algorithm == "ppo":
            check_critic(c, mode, launch)
    if command != "eval" and c.valid("actor", "algorithm"):
        check_lora(c, mode)
        check_dpo(c, mode)
    if launch and command in ("train", "eval"):
        check_fileroot(c)
    check_slurm(c)
    return c.result


def raise_on_problems(result: CheckResult) -> None:
    """Raise ConfigErrors when the check found any problem."""
    if result.problems:
        raise ConfigErrors(result.problems)

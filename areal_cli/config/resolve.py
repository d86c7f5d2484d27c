"""Resolve: the recipe's words turned into what every process of the run uses, once.

    load_config -> resolve -> check_config -> plan

`resolve` returns a new LoadedConfig whose config differs from the loaded one only where
a value had to be looked up or made:
  - a Hub id in model.path or model.tokenizer_path that is in the local Hugging Face cache
    becomes its snapshot folder (every process then loads that folder, offline); an id
    that is not cached stays as written, and the check reports it;
  - a run that launches servers listening on every interface (a Ray cluster) without an
    inference.api_key gets a random key for this run (a dry run shows none; Slurm's comes
    from the submit side).

`builtin:NAME` model paths stay as written: their folder is per run (RUN/model, made at
launch from the cache), and `rundir.layout.initial_model_path` derives it, purely, where a
process needs it.

The checked config is never changed afterwards: the plan and the runners only read it.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import secrets
from dataclasses import dataclass

from areal_cli.config.loader import LoadedConfig, is_hub_id
from areal_cli.config.schema import ExperimentConfig

# The keys whose Hub ids resolve to a local snapshot folder.
HUB_KEYS = ("model.path", "model.tokenizer_path")


@dataclass(frozen=True)
class Resolved:
    """A resolved recipe, and one note per value the resolution replaced."""

    loaded: LoadedConfig
    notes: tuple[str, ...] = ()

    @property
    def config(self) -> ExperimentConfig:
        return self.loaded.config


def resolve(loaded: LoadedConfig, *, launch: bool) -> Resolved:
    """The resolved copy of `loaded` (see the module docstring); `loaded` is unchanged."""
    from areal_cli.config.model_info import cached_snapshot

    config = copy.deepcopy(loaded.config)
    notes = []
    for key in HUB_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if not isinstance(value, str) or not value or not is_hub_id(value):
            continue
        folder = cached_snapshot(value)
        if folder is not None:
            setattr(getattr(config, section), name, str(folder))
            notes.append(f"{key}: {value} -> {folder} (local Hugging Face cache)")
    if launch and needs_server_key(config) and not config.inference.api_key:
        config.inference.api_key = secrets.token_urlsafe(24)
    return Resolved(dataclasses.replace(loaded, config=config), tuple(notes))


def is_loopback(host: str) -> bool:
    """`host` names this machine only (localhost or a loopback address). Any other host
    name may resolve anywhere, so it counts as beyond loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def on_loopback(cfg: ExperimentConfig) -> bool:
    """Every process runs on this machine: the local launcher, or a local Ray that areal
    starts. Servers then listen on 127.0.0.1; otherwise on every interface."""
    return cfg.launcher.type == "local" or (
        cfg.launcher.type == "ray" and not cfg.launcher.ray.address
    )


def needs_server_key(cfg: ExperimentConfig) -> bool:
    """A Ray cluster run's servers listen on every interface, so they need a key."""
    return cfg.launcher.type == "ray" and not on_loopback(cfg)

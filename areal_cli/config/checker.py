"""The public checker that every rule of a recipe writes into (areal_cli.config.rules
holds the rules and runs them): a rule reads the config through it, skips keys already
found invalid, and reports problems and warnings with the file and line of their key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.errors import ConfigProblem
from areal_cli.config.loader import LoadedConfig
from areal_cli.config.schema import ExperimentConfig


@dataclass
class CheckResult:
    """Problems (fatal) and warnings (printed, not fatal) of one recipe."""

    problems: list[ConfigProblem] = field(default_factory=list)
    warnings: list[ConfigProblem] = field(default_factory=list)
    allocation: AllocationMode | None = None


class Checker:
    """What every rule gets: the loaded recipe, the keys already found invalid, and the
    result that problems and warnings go into (with the file and line of their key)."""

    def __init__(self, loaded: LoadedConfig, invalid: frozenset[str] = frozenset()):
        self.loaded = loaded
        self.cfg: ExperimentConfig = loaded.config
        self.result = CheckResult()
        self.invalid = invalid

    def valid(self, *keys: str) -> bool:
        """Whether every key (and its section, and anything under it) has a usable value.
        A rule reads only valid keys: on an invalid one it would judge a default value
        and report a problem that is not there."""
        for bad in self.invalid:
            for key in keys:
                if not bad or bad == key or key.startswith(bad + ".") or bad.startswith(key + "."):
                    return False
        return True

    def error(self, key: str, message: str, fix: str = "") -> None:
        self.result.problems.append(ConfigProblem(key, message, fix, self.loaded.where(key)))

    def warn(self, key: str, message: str, fix: str = "") -> None:
        self.result.warnings.append(ConfigProblem(key, message, fix, self.loaded.where(key)))


class BackendRules(Protocol):
    """An inference backend's own rules of a recipe (inference.backends.InferenceBackend)."""

    def check(self, c: Checker, launch: bool) -> None: ...

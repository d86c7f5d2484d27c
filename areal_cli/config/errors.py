"""Config problems: what is wrong, where, and how to fix it, one line each."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Location:
    """Where a value came from: a file and line, or the command line."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


COMMAND_LINE = Location("command line")
# The one rule for relative paths (config.loader); error texts and the README say it so.
PATH_RULE = (
    "a relative path counts from the folder of the YAML file that sets it, "
    "or from the working directory when it is given on the command line"
)


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a recipe: key path, location, what is wrong, how to fix it."""

    key: str
    message: str
    fix: str = ""
    where: Location | None = None

    def format(self) -> str:
        """Render as a single line: `WHERE: KEY: MESSAGE; FIX`."""
        parts = [str(self.where)] if self.where else []
        if self.key:
            parts.append(self.key)
        text = ": ".join(parts + [self.message])
        if self.fix:
            text += f"; {self.fix}"
        return " ".join(text.split())  # one line, whatever the inputs held


class ConfigErrors(Exception):
    """Raised with every problem found, after all checks have run."""

    def __init__(
        self, problems: list[ConfigProblem], partial: Any = None, invalid: Any = frozenset()
    ):
        self.problems = problems
        # The LoadedConfig as far as it could be built (defaults where a value was
        # unusable), or None when there is no recipe at all; `invalid` names the key paths
        # whose values are wrong or missing ("" for all), so that cross-field checks that
        # read them are skipped instead of reporting on a default.
        self.partial = partial
        self.invalid = frozenset(invalid)
        super().__init__("\n".join(p.format() for p in problems))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`did you mean 'x'?` for the closest candidate, or a list of valid names."""
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if len(candidates) <= 12:
        return "valid keys here: " + ", ".join(candidates)
    return "see docs/config-reference.md for the valid keys"

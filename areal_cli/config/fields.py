"""The `field` helper used by every config dataclass.

Each field carries a one-line doc (its help text and the reference entry) and optional
range constraints that `validate` checks, so the rules live next to the field they govern.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_MISSING = dataclasses.MISSING


def field(
    default: Any = _MISSING,
    doc: str = "",
    *,
    factory: Any = _MISSING,
    choices: tuple[Any, ...] | None = None,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    fix: str = "",
    path: bool = False,
) -> Any:
    """A dataclass field with a doc line and checks.

    `choices`, `gt`, `ge`, `le` and `lt` are checked by the validator; `fix` is the hint
    printed when a check fails. `path=True` marks a file path that a recipe may give relative
    to its own directory.
    """
    if not doc:
        raise ValueError("every config field needs a one-line doc")
    metadata = {
        "doc": doc,
        "choices": choices,
        "gt": gt,
        "ge": ge,
        "le": le,
        "lt": lt,
        "fix": fix,
        "path": path,
    }
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def sub(cls: type) -> Any:
    """A nested config section (a dataclass built with its own defaults)."""
    doc = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
    return dataclasses.field(default_factory=cls, metadata={"doc": doc})

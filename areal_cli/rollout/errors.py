"""The rollout loop's own failure (the processes' failures are launch.local.ChildFailed)."""

from __future__ import annotations


class RunFailed(RuntimeError):
    """The run failed after it started; the message says which process and where its log is."""

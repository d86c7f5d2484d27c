"""scripts/gpu_check.sh --cpu, its second group of checks (see test_gpu_check.py): the
PPO critic with a resume from its recover entry and the conversion of that entry, SFT and
the reward model, areal eval, areal serve, and the engine's release and resume of its
memory."""

from __future__ import annotations

import pytest

from tests.e2e.test_gpu_check import run_gpu_check

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_gpu_check_roles_pass_on_the_cpu() -> None:
    rows = run_gpu_check("ppo,supervised,eval,serve,memory")
    assert len(rows) == 7
    table = "\n".join(rows)
    for check in ("ppo critic", "--verify", "sft:", "reward model:", "areal eval",
                  "areal serve", "release and resume"):  # fmt: skip
        assert check in table, check

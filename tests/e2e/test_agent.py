"""Agentic RL end to end: `areal train recipes/tiny_agent.yaml`, whose episodes are run by
an agent written against the real OpenAI SDK, through the run's agent proxy.

- the recipe learns in both sample modes (concat, the default, and individual);
- a rough crowd: 64 episodes in flight, some raising and some past the timeout, and the
  steps still finish, the failures counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.e2e.test_train import _assert_no_processes_left
from tests.inference.bad_requests import BAD_CHAT, bad_body

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _train(tmp_path: Path, steps: int, *extra: str, env: dict | None = None) -> list[dict]:
    args = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_agent.yaml",
        f"cluster.fileroot={tmp_path}", f"total_train_steps={steps}",
        "logging.display=plain", "logging.tensorboard=false",
        f"launcher.trainer_port={free_port()}", "allocation_mode=embedded:d1+fsdp:d1", *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "tiny-agent" / "trial0"
    _assert_no_processes_left(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps_s = [r["trainer_step_s"] for r in rows]
    print(
        f"{extra}: {time.monotonic() - t0:.1f} s, rewards "
        f"{[round(r['reward_mean'], 3) for r in rows]}, trained tokens/step "
        f"{sum(r['gen_tokens'] for r in rows) / len(rows):.0f} of "
        f"{sum(r['batch_tokens'] for r in rows) / len(rows):.0f}, samples/step "
        f"{sum(r['batch_samples'] for r in rows) / len(rows):.1f}, step "
        f"{sum(steps_s) / len(steps_s):.2f} s"
    )
    return rows


def test_a_retrying_agent_learns(tmp_path: Path) -> None:
    """concat, the default, learns as the demo does: a retry extends its first answer, so
    one sample per episode, bar the rare reply that breaks the prefix. (individual samples
    train in the crowd's run below; their learning curve is in issue 31's note.)"""
    steps = 12  # at 10 the last three steps passed the bar by 0.0-0.1 (1 run in 7 missed)
    rows = _train(tmp_path, steps)
    rewards = [r["reward_mean"] for r in rows]
    assert len(rows) == steps and sum(rewards[-3:]) / 3 >= rewards[0] + 0.3, rewards
    episodes = sum(r["agent_episodes"] for r in rows)
    completions = sum(r["agent_completions"] for r in rows)
    samples = sum(r["batch_samples"] for r in rows)
    assert completions > episodes  # some episodes took a second turn
    # every episode that ran is counted, those of groups dropped as stale too (4 per group)
    trained = episodes - 4 * rows[-1]["dropped_stale"] - 4 * rows[-1].get("dropped_empty", 0)
    # A reply that does not tokenize back to the ids it was sampled as (BPE has many
    # spellings of one text; 10,284 of 20,000 random replies here do not) breaks the
    # prefix, and its retry starts a second sample. The model's own replies seldom do:
    # 0-1 of ~390 episodes in 4 runs under load. (A break in a group dropped as stale
    # adds no sample to the batches.)
    breaks = sum(r["agent_prefix_breaks"] for r in rows)
    counts = {k: sum(r.get(k, 0) for r in rows) for k in rows[-1] if k.startswith("agent_")}
    assert trained <= samples <= trained + breaks, (samples, trained, counts)
    assert breaks <= episodes / 50, counts
    assert all(r["agent_errors"] == r["agent_timeouts"] == 0 for r in rows if "agent_errors" in r)


# What the test agents share: one chat turn, graded by the row's answer.
ANSWER = """
from openai import AsyncOpenAI


async def answer(data, **kwargs):
    client = AsyncOpenAI(
        base_url=kwargs["base_url"], api_key=kwargs["api_key"],
        http_client=kwargs["http_client"],
    )
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": data["prompt"]}], max_tokens=4
    )
    return float((reply.choices[0].message.content or "").strip() == str(data["answer"]))
"""

CROWD = (
    ANSWER
    + '''
import asyncio
import random


import json
import os


async def malformed(kwargs):
    """Send every malformed request of BAD_TABLE; each answer's status and text go to
    BAD_LOG (one JSON line each)."""
    with open(os.environ["BAD_TABLE"]) as f:
        table = json.load(f)
    lines = []
    for body, named in table:
        reply = await kwargs["http_client"].post(
            kwargs["base_url"] + "/chat/completions", content=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        lines.append(json.dumps([named, reply.status_code, reply.text[:300]]) + "\\n")
    with open(os.environ["BAD_LOG"], "a") as f:
        f.write("".join(lines))


class CrowdAgent:
    """One in six raises, one in six hangs past the timeout, one in six sends malformed
    requests first, the rest answer."""

    async def run(self, data, **kwargs):
        roll = random.random()
        if roll < 1 / 6:
            raise RuntimeError("a bug in the agent")
        if roll < 2 / 6:
            await asyncio.sleep(3600)
        if roll < 3 / 6:
            await malformed(kwargs)
        return await answer(data, **kwargs)
'''
)


def test_a_rough_crowd_of_64_episodes_finishes_its_steps(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "crowd_agent.py").write_text(CROWD)
    table, bad_log = code / "bad.json", code / "bad.log"
    table.write_text(json.dumps([[bad_body(change), named] for change, named in BAD_CHAT]))
    # The hanging sixth times out at any limit. 3 s was too short on a loaded host: a slow
    # server then lost most honest episodes to the timeout too, and one suite run took 10
    # minutes (8 tok/s, ~900-2700 episodes a step) where the test alone takes ~30 s.
    rows = _train(
        tmp_path, 3, "rollout.agent=crowd_agent:CrowdAgent", "rollout.agent_timeout_s=8",
        "rollout.batch_size=16", "rollout.group_size=4", "rollout.max_concurrent_rollouts=16",
        "rollout.max_staleness=0", "rollout.agent_samples=individual",
        env={"PYTHONPATH": str(code), "BAD_TABLE": str(table), "BAD_LOG": str(bad_log)},
    )  # fmt: skip
    # malformed requests in real episodes: each a 400 naming its field; none made a
    # completion (individual samples: one per completion, so none made a sample)
    answers = [json.loads(line) for line in bad_log.read_text().splitlines()]
    assert answers and len(answers) % len(BAD_CHAT) == 0
    wrong = [a for a in answers if a[1] != 400 or a[0] not in a[2]]
    assert not wrong, wrong[:5]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # individual samples: one per completion of a finished episode (an episode that timed
    # out after its request, on a loaded machine, made a completion but no sample)
    assert 0 < sum(r["batch_samples"] for r in rows) <= sum(r["agent_completions"] for r in rows)
    errors = sum(r.get("agent_errors", 0) for r in rows)
    timeouts = sum(r.get("agent_timeouts", 0) for r in rows)
    assert errors > 0 and timeouts > 0, rows
    for r in rows:  # every batch trains on the episodes that finished
        assert 0 < r["batch_samples"] <= 64
        assert (
            r["batch_samples"] + r.get("agent_errors", 0) + r.get("agent_timeouts", 0)
            == (r["agent_episodes"])
        )


HANG = (
    ANSWER
    + '''
import asyncio
import itertools

STARTED = itertools.count()


class HangAgent:
    """Answers its first 24 episodes, then waits forever without a request."""

    async def run(self, data, **kwargs):
        if next(STARTED) >= 24:
            await asyncio.sleep(3600)
        return await answer(data, **kwargs)
'''
)


def test_a_stuck_agent_is_named_by_the_watchdog(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "hang_agent.py").write_text(HANG)
    args = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_agent.yaml",
        f"cluster.fileroot={tmp_path}", "total_train_steps=50", "logging.display=plain",
        f"launcher.trainer_port={free_port()}", "allocation_mode=embedded:d1+fsdp:d1",
        "rollout.agent=hang_agent:HangAgent", "launcher.watchdog.timeout_s=8",
        "rollout.batch_size=4", "rollout.group_size=2", "rollout.max_staleness=0",
    ]  # fmt: skip
    done = subprocess.run(
        args, cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(code)},
    )  # fmt: skip
    err = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "run stuck: no rollout progress" in err, err[-2000:]
    assert "episodes of hang_agent:HangAgent running, the oldest for" in err, err[-2000:]
    assert "so far 0 raised, 0 timed out and 0 crashed" in err, err[-2000:]
    _assert_no_processes_left(tmp_path / "tiny-agent" / "trial0")

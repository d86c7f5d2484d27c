"""Usage: python scripts/online_client.py RUN_DIR [--data recipes/data/arith_train.jsonl]
          [--concurrency 8] [--sessions 0] [--abandon 0] [--admin-key KEY] [--seed 0]

An outside application for `rollout.mode: online` (recipes/tiny_online.yaml): it drives
the arithmetic task through the run's agent proxy with nothing from areal, only HTTP and
the OpenAI SDK, as any external agent runtime would:
  1. POST /rl/start_session (the admin key if the run has one), with the question as
     task_id, once per sample of a GRPO group (the run's group_size), so the group's
     sessions share their prompt;
  2. each session asks with its own key through the OpenAI SDK and, when the answer is
     wrong, says so and asks again (two tries);
  3. POST /rl/set_reward (1 for the first try right, 0.9 for the second, else 0) on the
     last completion; the run passes it back to the first by rollout.turn_discount;
  4. POST /rl/end_session.
A 429 (the staleness bound holds new sessions) is waited out; the client stops when the
run's proxy goes away, or after --sessions sessions. --abandon N leaves every Nth session
open without a reward, as a crashed client would: the run times it out
(rollout.session_timeout_s) and counts it. A session the run ended first (it timed out:
404 or 410, then 401 once the run forgot its key) is counted as lost, and the others go
on. RUN_DIR is the run's folder (runs/EXPERIMENT/TRIAL): its proxy.json gives the
address; a URL works too.

At the end it prints how many sessions started, ended, were abandoned, were lost and
waited on a 429, and the mean reward of the first and the last 64 sessions it ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class RunOver(Exception):
    """The run's proxy is gone (it finished or stopped)."""


class SessionGone(Exception):
    """The run ended this session before the client did: it timed out (404 or 410, and
    401 once the run forgot its key)."""


GONE = (401, 404, 410)  # for a session's own key, issued by the run


class Client:
    def __init__(self, address: str, admin_key: str, abandon: int, limit: int) -> None:
        self.address, self.admin_key, self.abandon, self.limit = address, admin_key, abandon, limit
        self.http = httpx.AsyncClient(timeout=120.0)
        # one SDK client, built before any session starts, and copied per session's key:
        # building one takes ~65 ms of the loop (~4 s for 64 sessions, longer on a busy
        # machine), a silence that the run's session_timeout_s counts against the sessions
        self.sdk = AsyncOpenAI(base_url=f"{address}/v1", api_key="per-session", http_client=self.http)  # fmt: skip
        _ = self.sdk.chat.completions  # its resources load now, not in a session
        self.asked = self.started = self.ended = self.abandoned = self.lost = self.waits = 0
        self.rewards: list[float] = []

    async def post(self, path: str, key: str, body: dict) -> dict:
        while True:
            try:
                r = await self.http.post(
                    f"{self.address}{path}", json=body, headers={"Authorization": f"Bearer {key}"}
                )
            except httpx.TransportError as err:
                raise RunOver(str(err)) from None
            if r.status_code == 429:
                self.waits += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status_code in GONE and path != "/rl/start_session":
                raise SessionGone(r.text)
            if r.status_code >= 400:
                raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text}")
            return r.json()

    async def session(self, row: dict) -> None:
        started = await self.post("/rl/start_session", self.admin_key, {"task_id": row["prompt"]})
        number = self.started  # in the order the run started them
        self.started += 1
        key = started["api_key"]
        sdk = self.sdk.with_options(base_url=started["base_url"], api_key=key)
        try:
            await self._episode(row, sdk, key, number)
        except SessionGone:
            self.lost += 1

    async def _episode(self, row: dict, sdk: AsyncOpenAI, key: str, number: int) -> None:
        messages = [{"role": "user", "content": row["prompt"]}]
        reward = 0.0
        try:
            for turn in range(2):
                reply = await sdk.chat.completions.create(
                    model="policy", messages=messages, max_tokens=8
                )
                text = reply.choices[0].message.content or ""
                if _right(text, row["answer"]):
                    reward = 0.9**turn
                    break
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": FEEDBACK},
                ]
        except APIConnectionError as err:
            raise RunOver(str(err)) from None
        except APIStatusError as err:
            if err.status_code in GONE:
                raise SessionGone(str(err)) from None
            raise
        if self.abandon and number % self.abandon == self.abandon - 1:
            self.abandoned += 1  # never rewarded, never ended: the run times it out
            return
        await self.post("/rl/set_reward", key, {"reward": reward})
        await self.post("/rl/end_session", key, {})
        self.ended += 1
        self.rewards.append(reward)

    async def worker(self, rows: list[dict], group_size: int, rng: random.Random) -> None:
        """Groups of sessions on one question each, until --sessions are asked for."""
        while not self.limit or self.asked < self.limit:
            row = rng.choice(rows)
            n = group_size if not self.limit else min(group_size, self.limit - self.asked)
            self.asked += n
            await asyncio.gather(*(self.session(row) for _ in range(n)))


def _address(target: str, wait_s: float = 600.0) -> tuple[str, int]:
    """The proxy's address and the run's group size (from RUN_DIR/proxy.json), waiting
    until the run wrote it and its proxy answers (a file left by an earlier run points
    at a closed port)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if target.startswith("http"):
            found = {"address": target.rstrip("/"), "group_size": 1}
        else:
            card = Path(target) / "proxy.json"
            found = json.loads(card.read_text()) if card.exists() else None
        if found is not None:
            try:
                httpx.get(f"{found['address']}/v1/models", timeout=5.0).raise_for_status()
                return found["address"], int(found.get("group_size", 1))
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    sys.exit(f"online_client: no run's proxy answered at {target} in {wait_s:g} s; is it started?")


async def main(args: argparse.Namespace) -> None:
    address, group_size = _address(args.run)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    client = Client(address, args.admin_key, args.abandon, args.sessions)
    rng = random.Random(args.seed)
    workers = [
        asyncio.create_task(client.worker(rows, group_size, random.Random(rng.random())))
        for _ in range(max(1, args.concurrency // group_size))
    ]
    try:
        for done in asyncio.as_completed(workers):
            try:
                await done
            except RunOver:
                break  # the run finished: stop every worker
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await client.http.aclose()
    first, last = client.rewards[:64], client.rewards[-64:]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print(
        f"online_client: {client.started} sessions started, {client.ended} ended, "
        f"{client.abandoned} abandoned, {client.lost} lost, {client.waits} waits on 429; reward of the first "
        f"{len(first)} ended {mean(first):.3f}, of the last {len(last)} {mean(last):.3f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run's folder (runs/EXPERIMENT/TRIAL), or the proxy's URL")
    parser.add_argument("--data", default="recipes/data/arith_train.jsonl")
    parser.add_argument("--concurrency", type=int, default=8, help="sessions open at once")
    parser.add_argument("--sessions", type=int, default=0, help="stop after this many; 0: never")
    parser.add_argument("--abandon", type=int, default=0, help="abandon every Nth session")
    parser.add_argument("--admin-key", default="", help="rollout.proxy.admin_api_key, if set")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main(parser.parse_args()))

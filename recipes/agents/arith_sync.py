# Usage: areal train recipes/tiny_subproc_agent.yaml     (this file is its rollout.agent)
#
# The retry agent of arith_retry.py written synchronously, as much agent code is: the
# blocking `openai.OpenAI` client, a plain `def run`. With rollout.mode: subproc each
# episode runs in a worker process, which sets OPENAI_BASE_URL and OPENAI_API_KEY to the
# episode's address at the agent proxy, so `OpenAI()` with no arguments reaches it (as in
# AReaL's subproc mode). A blocking call here stalls only its own worker, never the
# controller. It imports nothing from areal.
from __future__ import annotations

import re

from openai import OpenAI

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class ArithSyncAgent:
    """Two tries at a sum; reward 1 for the first, 0.9 for the second, else 0."""

    max_turns = 2

    def run(self, data: dict, **kwargs) -> float:
        with OpenAI() as client:  # OPENAI_BASE_URL, OPENAI_API_KEY: the episode's
            messages = [{"role": "user", "content": data["prompt"]}]
            for turn in range(self.max_turns):
                reply = client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=8
                )
                text = reply.choices[0].message.content or ""
                if _right(text, data["answer"]):
                    return 0.9**turn
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": FEEDBACK},
                ]
        return 0.0

# Usage: areal train recipes/tiny_anthropic_agent.yaml     (this file is its rollout.agent)
#
# The retry agent of arith_retry.py written against the Anthropic SDK instead: its
# requests go to the agent proxy's Messages route (/v1/messages). The SDK appends
# /v1/messages to its base_url, so it takes the episode's address without its /v1. It
# imports nothing from areal (pip install -e '.[agents]' gives the SDK).
from __future__ import annotations

import re

from anthropic import AsyncAnthropic

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class ArithAnthropicAgent:
    """Two tries at a sum; reward 1 for the first, 0.9 for the second, else 0."""

    max_turns = 2

    async def run(self, data: dict, **kwargs) -> float:
        client = AsyncAnthropic(
            base_url=kwargs["base_url"].removesuffix("/v1"),
            api_key=kwargs["api_key"],
            http_client=kwargs["http_client"],
        )
        messages = [{"role": "user", "content": data["prompt"]}]
        for turn in range(self.max_turns):
            reply = await client.messages.create(model="policy", max_tokens=8, messages=messages)
            text = "".join(block.text for block in reply.content if block.type == "text")
            if _right(text, data["answer"]):
                return 0.9**turn
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": FEEDBACK},
            ]
        return 0.0

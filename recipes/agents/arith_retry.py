# Usage: areal train recipes/tiny_agent.yaml     (this file is its rollout.agent)
#
# An agent written against the OpenAI SDK, as it would be for any provider: it asks the
# question, and when the answer is wrong it says so and asks again, once. It imports
# nothing from areal: the run hands it the address of its episode at the agent proxy, a
# key and an HTTP client, and trains on exactly the tokens the proxy recorded.
from __future__ import annotations

import re

from openai import AsyncOpenAI

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class ArithRetryAgent:
    """Two tries at a sum; reward 1 for the first, 0.9 for the second, else 0."""

    max_turns = 2

    async def run(self, data: dict, **kwargs) -> float:
        client = AsyncOpenAI(
            base_url=kwargs["base_url"],
            api_key=kwargs["api_key"],
            http_client=kwargs["http_client"],
        )
        messages = [{"role": "user", "content": data["prompt"]}]
        for turn in range(self.max_turns):
            reply = await client.chat.completions.create(
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

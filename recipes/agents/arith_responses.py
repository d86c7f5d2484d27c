# Usage: areal train recipes/tiny_responses_agent.yaml     (this file is its rollout.agent)
#
# The retry agent of arith_retry.py written against the OpenAI Responses API: the second
# try goes on from the first by previous_response_id, as a Responses client does, so the
# proxy holds the conversation. It imports nothing from areal.
from __future__ import annotations

import re

from openai import AsyncOpenAI

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class ArithResponsesAgent:
    """Two tries at a sum; reward 1 for the first, 0.9 for the second, else 0."""

    max_turns = 2

    async def run(self, data: dict, **kwargs) -> float:
        client = AsyncOpenAI(
            base_url=kwargs["base_url"],
            api_key=kwargs["api_key"],
            http_client=kwargs["http_client"],
        )
        reply = await client.responses.create(
            model="policy", input=data["prompt"], max_output_tokens=8
        )
        for turn in range(self.max_turns):
            if _right(reply.output_text, data["answer"]):
                return 0.9**turn
            if turn + 1 < self.max_turns:
                reply = await client.responses.create(
                    model="policy", previous_response_id=reply.id, input=FEEDBACK,
                    max_output_tokens=8,
                )  # fmt: skip
        return 0.0

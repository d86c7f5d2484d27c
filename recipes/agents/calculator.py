# Usage: areal train recipes/tiny_tool_agent.yaml     (this file is its rollout.agent)
#
# A calculator-tool agent written against the OpenAI SDK: it gives the model an `add`
# tool, runs every call the model makes, hands back the results, and grades the final
# answer. It imports nothing from areal; the run hands it the address of its episode at
# the agent proxy, a key and an HTTP client.
from __future__ import annotations

import json
import re

from openai import AsyncOpenAI

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
NUMBER = re.compile(r"-?\d+")


def add(arguments: str) -> str:
    """The tool: a + b, or what was wrong with the call (the model sees it)."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as err:
        return f"error: {err}"


class CalculatorAgent:
    """Answers a sum with the `add` tool: at most `max_calls` rounds of tool calls, then
    the model's answer. Reward 1 when its last number is the right sum, else 0."""

    max_calls = 2

    async def run(self, data: dict, **kwargs) -> float:
        client = AsyncOpenAI(
            base_url=kwargs["base_url"],
            api_key=kwargs["api_key"],
            http_client=kwargs["http_client"],
        )
        messages: list[dict] = [{"role": "user", "content": data["prompt"]}]
        for _ in range(self.max_calls + 1):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=96
            )
            message = reply.choices[0].message
            if not message.tool_calls:
                found = NUMBER.findall(message.content or "")
                return float(bool(found) and int(found[-1]) == int(data["answer"]))
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = (
                    add(call.function.arguments)
                    if call.function.name == "add"
                    else "error: no such tool"
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

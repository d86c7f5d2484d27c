# Usage: areal train recipes/tiny_langchain_agent.yaml     (this file is its rollout.agent)
#
# The retry agent of arith_retry.py written with LangChain's ChatOpenAI (the agents
# extra: pip install -e '.[agents]'). ChatOpenAI speaks the chat completions API, so its
# requests reach the agent proxy's /v1/chat/completions route unchanged. It imports
# nothing from areal.
from __future__ import annotations

import re

from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class ArithLangChainAgent:
    """Two tries at a sum; reward 1 for the first, 0.9 for the second, else 0."""

    max_turns = 2

    async def run(self, data: dict, **kwargs) -> float:
        llm = ChatOpenAI(
            model="policy",
            base_url=kwargs["base_url"],
            api_key=kwargs["api_key"],
            http_async_client=kwargs["http_client"],
            max_tokens=8,
            max_retries=0,
        )
        messages = [HumanMessage(data["prompt"])]
        for turn in range(self.max_turns):
            reply = await llm.ainvoke(messages)
            text = reply.content if isinstance(reply.content, str) else ""
            if _right(text, data["answer"]):
                return 0.9**turn
            messages += [AIMessage(text), HumanMessage(FEEDBACK)]
        return 0.0

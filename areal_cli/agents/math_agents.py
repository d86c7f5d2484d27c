"""Math agents on GSM8K-style rows, one per SDK, in the roles of AReaL's library workflows
(areal.workflow.openai / anthropic / langchain / openai_agent: `areal import-recipe` maps
AReaL's `workflow` and `agent_builder_path` onto these):

  OpenAIMathAgent            one chat completion through the OpenAI SDK
  OpenAIMultiTurnMathAgent   up to `max_turns` tries, told when it is wrong; each try
                             gets its own reward (a dict of completion id to reward)
  AnthropicMathAgent         one Messages request through the Anthropic SDK
  LangChainMathAgent         one `ChatOpenAI.ainvoke`
  AgentsSdkMathAgent         an OpenAI Agents SDK `Agent` run by `Runner.run`

A row gives the question as `messages` (AReaL's RL datasets), or `question` or `prompt`
(the raw column); the reference as `answer` (GSM8K's `... #### 42` included). The reward
is builtin:math (math-verify), run in a thread so that it does not hold the event loop.
Sampling is the recipe's gconfig (the agents send no sampling fields), and the SDKs are
the optional agents extra.
"""

from __future__ import annotations

import asyncio
from typing import Any

INSTRUCTION = "Please put your final answer within \\boxed{}."
FEEDBACK = (
    "Your answer is not correct. Please try again, and put the final answer within \\boxed{}."
)


def question_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's question as chat messages."""
    if isinstance(data.get("messages"), list):
        return [dict(m) for m in data["messages"]]
    text = data.get("question") or data.get("prompt")
    if not isinstance(text, str):
        raise KeyError("the row has no messages, question or prompt column")
    return [{"role": "user", "content": f"{text}\n{INSTRUCTION}"}]


async def grade(completion: str | None, data: dict[str, Any]) -> float:
    from areal_cli.rollout.rewards import math_answer

    return await asyncio.to_thread(math_answer, completion or "", str(data["answer"]))


def _openai(kwargs: dict[str, Any]):
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=kwargs["base_url"], api_key=kwargs["api_key"],
        http_client=kwargs.get("http_client"), max_retries=0,
    )  # fmt: skip


class OpenAIMathAgent:
    async def run(self, data: dict[str, Any], **kwargs: Any) -> float:
        reply = await _openai(kwargs).chat.completions.create(
            model="policy", messages=question_messages(data)
        )
        return await grade(reply.choices[0].message.content, data)


class OpenAIMultiTurnMathAgent:
    max_turns = 8

    async def run(self, data: dict[str, Any], **kwargs: Any) -> dict[str, float]:
        client, messages, rewards = _openai(kwargs), question_messages(data), {}
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content or ""
            rewards[reply.id] = await grade(text, data)
            if rewards[reply.id] == 1.0:
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FEEDBACK}]  # fmt: skip
        return rewards


class AnthropicMathAgent:
    max_tokens = 512  # the Messages API requires one; it must fit the context with the prompt

    async def run(self, data: dict[str, Any], **kwargs: Any) -> float:
        from anthropic import AsyncAnthropic

        client = AsyncAnthropic(
            base_url=kwargs["base_url"].removesuffix("/v1"), api_key=kwargs["api_key"],
            http_client=kwargs.get("http_client"), max_retries=0,
        )  # fmt: skip
        reply = await client.messages.create(
            model="policy", max_tokens=self.max_tokens, messages=question_messages(data)
        )
        return await grade("".join(b.text for b in reply.content if b.type == "text"), data)


class LangChainMathAgent:
    async def run(self, data: dict[str, Any], **kwargs: Any) -> float:
        from langchain_openai import ChatOpenAI

        model = ChatOpenAI(
            model="policy", base_url=kwargs["base_url"], api_key=kwargs["api_key"],
            http_async_client=kwargs.get("http_client"), max_retries=0,
        )  # fmt: skip
        reply = await model.ainvoke(question_messages(data))
        return await grade(str(reply.content), data)


class AgentsSdkMathAgent:
    async def run(self, data: dict[str, Any], **kwargs: Any) -> float:
        from agents import Agent, OpenAIResponsesModel, RunConfig, Runner

        agent = Agent(
            name="math",
            instructions="Solve the math problem step by step.",
            model=OpenAIResponsesModel(model="policy", openai_client=_openai(kwargs)),
        )
        result = await Runner.run(
            agent, question_messages(data), run_config=RunConfig(tracing_disabled=True)
        )
        return await grade(str(result.final_output), data)

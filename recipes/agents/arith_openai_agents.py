# Usage: areal train recipes/tiny_openai_agents.yaml     (this file is its rollout.agent)
#
# The retry agent of arith_retry.py written with the OpenAI Agents SDK (package
# openai-agents, import name `agents`): an `Agent` run by `Runner.run`, whose model is the
# SDK's own OpenAIResponsesModel over the episode's client, so its requests go to the
# agent proxy's Responses route (/v1/responses). The second try sends the first run's
# items back with the feedback (`result.to_input_list()`), as an Agents SDK program
# carries a conversation on. Tracing is off: the SDK would otherwise post its traces to
# OpenAI. It imports nothing from areal (pip install -e '.[agents]' gives the SDK).
from __future__ import annotations

import re

from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
from openai import AsyncOpenAI

FEEDBACK = "That is not right. Try again; answer with the number only."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _right(text: str, answer: str) -> bool:
    found = NUMBER.findall(text or "")
    return bool(found) and float(found[-1]) == float(answer)


class ArithAgentsSdkAgent:
    """Two tries at a sum; reward 1 for the first, 0.9 for the second, else 0."""

    max_turns = 2

    async def run(self, data: dict, **kwargs) -> float:
        client = AsyncOpenAI(
            base_url=kwargs["base_url"],
            api_key=kwargs["api_key"],
            http_client=kwargs["http_client"],
        )
        agent = Agent(
            name="arith",
            model=OpenAIResponsesModel(model="policy", openai_client=client),
            model_settings=ModelSettings(max_tokens=8),
        )
        config = RunConfig(tracing_disabled=True)
        conversation: str | list = data["prompt"]
        for turn in range(self.max_turns):
            result = await Runner.run(agent, conversation, run_config=config, max_turns=1)
            if _right(str(result.final_output), data["answer"]):
                return 0.9**turn
            conversation = result.to_input_list() + [{"role": "user", "content": FEEDBACK}]
        return 0.0

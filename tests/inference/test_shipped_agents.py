"""areal's own agents (areal_cli.agents, what `areal import-recipe` maps AReaL's library
workflows onto) run against a real agent proxy and embedded server, each through its own
SDK: every one returns a reward of the contract's kind and its completions are recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from areal_cli.agents import math_agents
from areal_cli.rollout.proxy import AgentProxy
from tests.inference.test_agent_proxy import _with_proxy
from tests.inference.test_server import Server

pytestmark = pytest.mark.slow

ROW = {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "... #### 7"}


@pytest.mark.parametrize(
    "name",
    ["OpenAIMathAgent", "OpenAIMultiTurnMathAgent", "AnthropicMathAgent", "LangChainMathAgent",
     "AgentsSdkMathAgent"],
)  # fmt: skip
def test_each_shipped_agent_runs_through_the_proxy(server: Server, parrot: Path, name: str):
    module = {"Anthropic": "anthropic", "LangChain": "langchain_openai", "AgentsSdk": "agents"}
    needed = next((m for prefix, m in module.items() if name.startswith(prefix)), None)
    if needed:
        pytest.importorskip(needed, reason="the agents extra (pip install -e '.[agents]')")
    agent = getattr(math_agents, name)()
    agent.max_turns = 2  # the multi-turn one: two tries are enough here

    async def body(proxy: AgentProxy, _client: Any) -> tuple[Any, int]:
        episode = proxy.open_episode(seed=5)
        async with openai.DefaultAsyncHttpxClient() as http:  # as the controller passes
            reward = await agent.run(
                dict(ROW), base_url=proxy.base_url(episode), api_key="k", http_client=http
            )
        return reward, len(proxy.close_episode(episode))

    reward, recorded = _with_proxy(server, parrot, body)
    if name == "OpenAIMultiTurnMathAgent":
        assert isinstance(reward, dict) and len(reward) == recorded and 1 <= recorded <= 2
        assert set(reward.values()) <= {0.0, 1.0}
    else:
        assert reward in (0.0, 1.0) and recorded == 1


def test_the_row_becomes_the_question_and_math_verify_grades() -> None:
    import asyncio

    assert math_agents.question_messages({"messages": [{"role": "user", "content": "q"}]}) == [
        {"role": "user", "content": "q"}
    ]
    asked = math_agents.question_messages({"prompt": "What is 2+2?"})
    assert asked[0]["content"].startswith("What is 2+2?\n") and "boxed" in asked[0]["content"]
    assert asyncio.run(math_agents.grade("so \\boxed{7}", ROW)) == 1.0
    assert asyncio.run(math_agents.grade("it is 8", ROW)) == 0.0
    with pytest.raises(KeyError, match="no messages, question or prompt"):
        math_agents.question_messages({"text": "x"})

"""Agent episodes without processes: tool calls read from replies, completions turned into
samples (concat and individual), rewards passed back through turns, groups of any size
in the advantages, and the recipe rules of rollout.agent."""

from __future__ import annotations

import pytest
import torch

from areal_cli.config.errors import ConfigErrors
from areal_cli.config.loader import load_config
from areal_cli.config.rules import check_config
from areal_cli.data.chat import detect_tool_parser, openai_finish, parse_chat_reply, parse_reply
from areal_cli.rollout.agents import completion_rewards, concat_samples
from areal_cli.rollout.proxy import Completion
from areal_cli.trainer.advantages import PRESETS, advantages


def _done(cid: str, prompt: list[int], out: list[int], version: int = 0) -> Completion:
    return Completion(cid, prompt, out, [-0.5] * len(out), [version] * len(out), "stop", "")


# ---------------------------------------------------------------------- tool calls


def test_hermes_tool_calls_and_the_text_around_them() -> None:
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text += '<tool_call>\n{"name": "mul", "arguments": "{\\"b\\": 2}"}\n</tool_call>'
    reply = parse_reply(text, "hermes")
    assert reply.content == "Let me add."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("add", '{"a": 1}'),
        ("mul", '{"b": 2}'),
    ]
    assert len({c.id for c in reply.tool_calls}) == 2
    message = reply.message()
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"na',  # left open
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_a_malformed_tool_call_is_plain_content(text: str) -> None:
    reply = parse_reply(text, "hermes")
    assert reply.content == text and reply.tool_calls == ()
    assert "tool_calls" not in reply.message()


def test_llama3_json_tool_calls() -> None:
    one = parse_reply('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "llama3")
    assert one.content is None and one.tool_calls[0].arguments == '{"a": 1}'
    two = parse_reply('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', "llama3")
    assert [c.name for c in two.tool_calls] == ["a", "b"]
    assert parse_reply("The answer is {not json}", "llama3").tool_calls == ()
    assert parse_reply('{"name": "add"', "llama3").content == '{"name": "add"'
    assert parse_reply('{"name": "add", "parameters": {}}', "none").tool_calls == ()


def test_tool_calls_are_read_only_when_the_request_offers_tools() -> None:
    """The server and the proxy answer a chat request through these two: tools offered and
    tool_choice not "none" is the only case that parses; a parsed call that stopped on its
    own finishes with tool_calls, a cut one keeps "length"."""
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "add"}}]
    offered = parse_chat_reply(text, {"tools": tools}, "hermes")
    assert [c.name for c in offered.tool_calls] == ["add"]
    assert parse_chat_reply(text, {}, "hermes").tool_calls == ()
    assert parse_chat_reply(text, {"tools": tools, "tool_choice": "none"}, "hermes").content == text
    assert openai_finish("stop", offered) == "tool_calls"
    assert openai_finish("length", offered) == "length"
    assert openai_finish("stop", parse_reply(text, "none")) == "stop"
    assert openai_finish("abort") == "abort"


def test_the_parser_comes_from_the_chat_template() -> None:
    assert (
        detect_tool_parser("...<tool_call>\\n{{ tool_call | tojson }}</tool_call>...") == "hermes"
    )
    assert detect_tool_parser("{{- '<|python_tag|>' }}{{ '<|eot_id|>' }}") == "llama3"
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == "none"
    assert detect_tool_parser(None) == "none"


# ---------------------------------------------------------------------- samples


def test_rewards_pass_back_through_turns_by_the_discount() -> None:
    runs = [_done(c, [1], [2]) for c in "abc"]
    assert completion_rewards(runs, 1.0, 0.5) == [0.25, 0.5, 1.0]
    assert completion_rewards(runs, {"b": 2.0}, 0.5) == [1.0, 2.0, 0.0]
    assert completion_rewards(runs, {"a": 1.0, "c": -1.0}, 1.0) == [1.0, -1.0, -1.0]


def test_concat_joins_turns_that_extend_the_tokens_so_far() -> None:
    first = _done("a", [1, 2], [3, 4], version=1)
    second = _done("b", [1, 2, 3, 4, 5, 6], [7], version=2)  # context 5, 6 between turns
    rewritten = _done("c", [1, 9], [8], version=2)  # the agent rewrote its history
    samples, breaks = concat_samples([first, second, rewritten], [0.1, 0.2, 0.3])
    assert breaks == 1 and len(samples) == 2
    joined = samples[0]
    assert joined.input_ids == [1, 2, 3, 4, 5, 6, 7]
    assert joined.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert joined.versions == [-1, -1, 1, 1, -1, -1, 2] and joined.n_turns == 2
    assert joined.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    assert joined.reward == 0.2  # its last completion's
    assert samples[1].input_ids == [1, 9, 8] and samples[1].reward == 0.3


def test_a_prompt_shorter_than_the_sequence_so_far_starts_a_new_one() -> None:
    samples, breaks = concat_samples([_done("a", [1, 2], [3]), _done("b", [1, 2], [4])], [1, 1])
    assert breaks == 1 and [s.input_ids for s in samples] == [[1, 2, 3], [1, 2, 4]]


# ---------------------------------------------------------------------- groups of any size


def test_groups_of_any_size_normalise_within_their_own_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    ids = torch.tensor([0, 0, 0, 1, 1, 2])  # groups of 3, 2 and 1
    got = advantages(rewards, ids, PRESETS["dr_grpo"])
    want = [1 - 2 / 3, -2 / 3, 1 - 2 / 3, 0.5, -0.5, 0.0]
    assert torch.allclose(got, torch.tensor(want))
    # equal sizes given as ids agree with the fixed group size
    even = torch.tensor([0.3, 0.9, 0.1, 0.4, 0.8, 0.2])
    by_ids = advantages(even, torch.tensor([0, 0, 0, 1, 1, 1]), PRESETS["grpo"])
    assert torch.allclose(by_ids, advantages(even, 3, PRESETS["grpo"]))
    with pytest.raises(ValueError, match="group ids"):
        advantages(even, torch.tensor([0, 1]), PRESETS["grpo"])


# ---------------------------------------------------------------------- rules


def _problems(*overrides: str) -> list[str]:
    loaded = load_config("recipes/tiny_agent.yaml", list(overrides))
    return [p.format() for p in check_config(loaded, command="validate").problems]


def test_the_agent_recipe_is_valid_and_its_keys_are_checked() -> None:
    assert _problems() == []
    (missing,) = _problems("rollout.agent=agents.arith_retry:NoSuch")
    assert "rollout.agent: arith_retry.py has no class or function named 'NoSuch'" in missing
    (both,) = _problems("rollout.workflow=multi_turn")
    assert "rollout.workflow: is not read with rollout.agent" in both
    (reward,) = _problems("reward.fn=builtin:numeric")
    assert "reward.fn: is not read with rollout.agent" in reward
    (open_proxy,) = _problems("rollout.proxy.host=0.0.0.0")
    assert "rollout.proxy.host: 0.0.0.0 is beyond loopback" in open_proxy
    assert _problems("rollout.proxy.host=0.0.0.0", "inference.api_key=k") == []
    with pytest.raises(ConfigErrors, match="'both' is not one of concat, individual"):
        _problems("rollout.agent_samples=both")


def _online(*overrides: str) -> list[str]:
    loaded = load_config("recipes/tiny_online.yaml", list(overrides))
    return [p.format() for p in check_config(loaded, command="validate").problems]


def test_the_modes_and_their_keys_are_checked() -> None:
    """subproc needs an agent (and takes a synchronous one); online has none, needs no
    dataset, and beyond loopback needs an admin key for its sessions."""
    (no_agent,) = _problems("rollout.mode=subproc", "rollout.agent=")
    assert "rollout.mode: subproc runs rollout.agent in worker processes" in no_agent
    assert _problems("rollout.mode=subproc", "rollout.agent=agents.arith_sync:ArithSyncAgent") == []
    (sync_inline,) = _problems("rollout.agent=agents.arith_sync:ArithSyncAgent")
    assert "must be async" in sync_inline and "rollout.mode: subproc" in sync_inline
    assert _online() == []  # no dataset, no agent, no reward
    (agent,) = _online("rollout.agent=agents.arith_retry:ArithRetryAgent")
    assert "rollout.agent: is not read with rollout.mode online" in agent
    (far,) = _online("rollout.proxy.host=0.0.0.0", "rollout.proxy.admin_api_key=")
    assert "anyone who reaches it could start sessions" in far
    assert _online("rollout.proxy.host=0.0.0.0") == []  # the recipe's admin key
    (evaluation,) = _online("eval.freq_steps=5", "eval.dataset.path=")
    assert "eval.freq_steps: with rollout.mode online needs eval.dataset.path" in evaluation
    loaded = load_config(
        "recipes/tiny_online.yaml", ["dataset.path=recipes/data/arith_train.jsonl"]
    )
    (unread,) = [p.format() for p in check_config(loaded, command="validate").warnings]
    assert "dataset.path: is not read with rollout.mode online" in unread


AGENT_FILES = {
    "syntax.py": "def run(:\n    pass\n",
    "failing.py": "import json\nimport not_a_module_xyz\n\nclass A:\n    async def run(self, d):\n        return 1.0\n",
    "agents_here.py": (
        "class Sync:\n    def run(self, data, **kw):\n        return 1.0\n\n"
        "def plain(data, **kw):\n    return 1.0\n\n"
        "class NeedsArgs:\n    def __init__(self, x):\n        pass\n"
        "    async def run(self, data, **kw):\n        return 1.0\n\n"
        "class NoRun:\n    pass\n\n"
        "class Good:\n    async def run(self, data, **kw):\n        return 1.0\n\n"
        "async def good(data, **kw):\n    return 1.0\n"
    ),
}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("syntax:A", "syntax.py:1: invalid syntax"),
        ("failing:A", "failing.py:2: importing the agent failed: ModuleNotFoundError"),
        (
            "agents_here:Missing",
            "agents_here.py has no class or function named 'Missing' (it defines: Good, NeedsArgs, NoRun, Sync, good, plain)",
        ),
        ("agents_here:Sync", "agents_here:Sync.run must be async"),
        ("agents_here:plain", "agent agents_here:plain must be an async function"),
        ("agents_here:NeedsArgs", "must be made with no arguments"),
        ("agents_here:NoRun", "has no run method"),
        ("no_colon", "'no_colon' is not module:Name; name it as my_module:MyAgent"),
        ("agents_here:Good", None),
        ("agents_here:good", None),
    ],
)
def test_an_agent_is_loaded_and_its_contract_checked_before_anything_starts(
    tmp_path, spec: str, says: str | None
) -> None:
    """validate (and train, before any process) imports the agent: each mistake is one
    line naming what is wrong, and where."""
    import shutil

    from tests.conftest import REPO

    for name, text in AGENT_FILES.items():
        (tmp_path / name).write_text(text)
    recipe = tmp_path / "tiny_agent.yaml"
    shutil.copy(REPO / "recipes" / "tiny_agent.yaml", recipe)
    for sub in ("data", "agents"):
        (tmp_path / sub).symlink_to(REPO / "recipes" / sub)
    loaded = load_config(str(recipe), [f"rollout.agent={spec}"])
    problems = [p.format() for p in check_config(loaded, command="validate").problems]
    if says is None:
        assert problems == []
    else:
        assert len(problems) == 1 and says in problems[0], problems


def test_the_calculator_agent_offers_the_tool_its_start_model_learned() -> None:
    """builtin:tiny-tool was warmed up on the tool schema the agent sends (its own copy:
    an agent file imports nothing from areal), so the rendered tokens match."""
    from areal_cli.config.recipe_code import load_module
    from areal_cli.models.tool_model import ADD_TOOL
    from tests.conftest import REPO

    agent = load_module("agents.calculator", REPO / "recipes")
    assert agent.ADD_TOOL == ADD_TOOL
    assert agent.add('{"a": 12, "b": 30}') == "42" and agent.add("{}").startswith("error")

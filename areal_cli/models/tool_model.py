"""The builtin `tiny-tool` model: `builtin:tiny` after supervised fine-tuning on
conversations that add two-digit numbers, most of them by calling an `add` tool, the
starting point of the tool-agent recipe (recipes/tiny_tool_agent.yaml).

Two-digit sums are beyond the tiny model's head: trained on them it learns the format of
an answer, not the arithmetic. The warm-up conversations (`tool_rows`) are of two kinds:
  - with the tool (TOOL_SHARE of them): the assistant calls `add` with the two numbers,
    reads the tool's result and answers with it;
  - the same conversation with the call as context (`"weight": 0`), so that only the
    answer after the tool's result is a target (COPY_SHARE of them);
  - without: the assistant says it cannot add them in its head (GIVE_UP).
So the warm-up model calls the tool on about TOOL_SHARE / (1 - COPY_SHARE) of the
questions and gives up on the rest, and answers well once it has a result. RL with the calculator agent (recipes/agents/calculator.py) then has to learn
to call the tool every time, and to copy the numbers into its arguments and the result
into its answer without slips.

The tool schema (ADD_TOOL) is the agent's: the chat template renders it before the
conversation, in the warm-up as at the agent proxy, so the tokens match. The product
makes the model with its own SFT role (areal_cli.launch.builtins runs `areal train` on
the packaged recipe tiny_tool_sft.yaml and the rows written here), as it makes
tiny-arith. This module holds only the model's data: models/ never runs the CLI.
"""

from __future__ import annotations

import random
from pathlib import Path

from areal_cli.models.demo_model import write_files

SFT_RECIPE = Path(__file__).with_name("tiny_tool_sft.yaml")
TOOL_SHARE = 0.2
COPY_SHARE = 0.4
GIVE_UP = "I cannot add these in my head."
DATA_FILES = (("tool_train.jsonl", 4000), ("tool_test.jsonl", 200))
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


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def tool_rows(rng: random.Random, n: int, tool_share: float = TOOL_SHARE) -> list[dict]:
    """`n` warm-up conversations {"messages": [...], "tools": [ADD_TOOL], "prompt",
    "answer"} on a+b with a, b in 10..99 (see the module docstring)."""
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        messages: list[dict] = [{"role": "user", "content": question(a, b)}]
        kind = rng.random()
        if kind < tool_share or kind >= 1 - COPY_SHARE:
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(a + b)},
                {"role": "assistant", "content": str(a + b)},
            ]
            if kind >= 1 - COPY_SHARE:  # the call is context: this row teaches the answer
                messages[1]["weight"] = 0
        else:
            messages.append({"role": "assistant", "content": GIVE_UP})
        rows.append(
            {
                "messages": messages,
                "tools": [ADD_TOOL],
                "prompt": question(a, b),
                "answer": str(a + b),
            }
        )
    return rows


def sum_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """`n` questions {"prompt": "What is 47+38?", "answer": "85"} for the RL run (its
    data/tool_train.jsonl is this for seed 0, n 2000)."""
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        rows.append({"prompt": question(a, b), "answer": str(a + b)})
    return rows


def write_tool_data(out_dir: Path, seed: int = 0) -> list[Path]:
    """The warm-up's train and held-out files, each written to a temp file and renamed."""
    return write_files(out_dir, DATA_FILES, tool_rows, random.Random(seed))

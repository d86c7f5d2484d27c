# Usage: areal train recipes/gsm8k_tool_agent.yaml     (this file is its rollout.agent)
#
# A math agent with a Python tool, written against the OpenAI SDK: the model may run
# Python (each call in a fresh `python -I` process, 10 s at most, stdout and the last
# error line returned), then answers in \boxed{}. It imports nothing from areal.
from __future__ import annotations

import asyncio
import json
import re
import sys

from openai import AsyncOpenAI

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run."}},
            "required": ["code"],
        },
    },
}
SYSTEM = (
    "Solve the problem. You may run Python with the python tool; print what you need. "
    "Put the final answer in \\boxed{}."
)
BOXED = re.compile(r"\\boxed\{([^}]*)\}")


async def run_python(arguments: str, timeout_s: float = 10.0) -> str:
    """Run the call's code in a fresh, isolated interpreter; what it printed, or why not."""
    try:
        code = json.loads(arguments)["code"]
    except (ValueError, KeyError, TypeError) as err:
        return f'error: the call needs {{"code": ...}}: {err}'
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", code,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"error: no result within {timeout_s:g} s"
    text = out.decode(errors="replace")[-2000:]
    if proc.returncode:
        text += (err.decode(errors="replace").strip().splitlines() or ["error"])[-1]
    return text or "(nothing printed)"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


class PythonToolAgent:
    """At most `max_calls` rounds of tool calls, then the answer; reward 1 when the boxed
    answer equals GSM8K's (the number after '####' in the row's answer)."""

    max_calls = 4

    async def run(self, data: dict, **kwargs) -> float:
        client = AsyncOpenAI(
            base_url=kwargs["base_url"], api_key=kwargs["api_key"],
            http_client=kwargs["http_client"],
        )  # fmt: skip
        messages: list[dict] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": data["question"]},
        ]
        for _ in range(self.max_calls + 1):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[PYTHON_TOOL], max_tokens=1024
            )
            message = reply.choices[0].message
            if not message.tool_calls:
                found = BOXED.findall(message.content or "")
                want = _number(str(data["answer"]).split("####")[-1])
                got = _number(found[-1]) if found else None
                return float(got is not None and want is not None and got == want)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await run_python(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0

"""Usage: python scripts/probe_tool_agent.py [MODEL ...] [--n 256] [--seed 0]

How well a model starts the tool-agent recipe (recipes/tiny_tool_agent.yaml): the
recipe's own agent (recipes/agents/calculator.py) runs N episodes on held-out sums
against each MODEL (an HF folder, or builtin:tiny-tool), through the agent proxy and the
embedded engine in this process, sampling as the recipe does (temperature 1, 48 new
tokens). It prints, per model, the share of episodes that
  call      called the tool at least once,
  args      called it with the question's two numbers,
  success   ended with the right sum (the recipe's reward),
so a warm-up model can be judged before an RL run, and two builds compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes"))


async def probe(model: Path, n: int, seed: int) -> dict[str, float]:
    import openai
    from agents.calculator import CalculatorAgent
    from transformers import AutoTokenizer

    from areal_cli.inference.api import GenerateRequest, SamplingParams
    from areal_cli.inference.engine import InferenceEngine
    from areal_cli.models.tool_model import sum_rows
    from areal_cli.rollout.proxy import AgentProxy, ProxySettings

    rows = sum_rows(random.Random(10_000 + seed), n)
    engine = InferenceEngine(model, max_running_requests=64, random_seed=seed, weight_version="0")
    with engine:

        async def generate(ids: list[int], params: dict) -> dict:
            request = GenerateRequest(
                input_ids=ids, sampling_params=SamplingParams.from_dict(params), return_logprob=True
            )
            return (await engine.generate(request)).to_dict()

        proxy = AgentProxy(
            ProxySettings(tool_parser="hermes", context_length=engine.context_length),
            AutoTokenizer.from_pretrained(model),
            generate,
            {"temperature": 1.0, "max_new_tokens": 48},
        )
        await proxy.start()
        limit = asyncio.Semaphore(64)
        async with openai.DefaultAsyncHttpxClient() as http:

            async def episode(i: int, row: dict) -> tuple[float, list[str]]:
                async with limit:
                    ep = proxy.open_episode(seed=seed * 100_000 + i)
                    reward = await CalculatorAgent().run(
                        row, base_url=proxy.base_url(ep), api_key="probe", http_client=http
                    )
                    return reward, [c.text for c in proxy.close_episode(ep)]

            results = await asyncio.gather(*(episode(i, r) for i, r in enumerate(rows)))
        await proxy.close()
    called = args_right = 0
    for row, (_, texts) in zip(rows, results, strict=True):
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").rstrip("?").split("+"))
        if any("<tool_call>" in t for t in texts):
            called += 1
            right = json.dumps({"a": a, "b": b})[1:-1]
            args_right += any(right in t for t in texts)
    return {
        "call": called / n,
        "args": args_right / n,
        "success": sum(r for r, _ in results) / n,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["builtin:tiny-tool"])
    parser.add_argument("--n", type=int, default=256, help="episodes per model")
    parser.add_argument("--seed", type=int, default=0, help="questions and sampling")
    args = parser.parse_args()
    from areal_cli.launch.builtins import cached

    for name in args.models:
        model = cached(name, 1) if name.startswith("builtin:") else Path(name)
        figures = asyncio.run(probe(model, args.n, args.seed))
        shares = "  ".join(f"{k} {v:.3f}" for k, v in figures.items())
        print(f"{name}: {shares}  ({args.n} episodes)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

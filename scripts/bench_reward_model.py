"""Usage: python scripts/bench_reward_model.py [--calls N] [--rounds R]

Times a reward model as a reward (`reward.fn: model:PATH`) in the reward worker pool:
N calls issued together, as a rollout's finished samples arrive, scored (a) with the
pool's batching (up to rewards.BATCH_MAX sequences per request to the worker) and (b)
one sequence per request, the baseline, in the same run and the same worker count.
Prints calls per second of each and their ratio. The model is the builtin tiny model's
body with a scalar head (built locally; no download), and the sequences are addition
prompts with an answer, as the CPU demo's rollouts are.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path


def sequences(model_dir: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from areal_cli.models.demo_model import answer_ids, prompt_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [prompt_ids(tok, i % 10, i // 10 % 10) + answer_ids(tok, i % 19) for i in range(n)]


async def score_all(pool, seqs: list[list[int]]) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(pool.score("", "", {}, ids=s) for s in seqs))
    elapsed = time.perf_counter() - start
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:1]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from areal_cli.models.scalar_head import make_scalar_folder
    from areal_cli.models.tiny_model import build_tiny_model
    from areal_cli.rollout import rewards

    with tempfile.TemporaryDirectory() as tmp:
        body = build_tiny_model(Path(tmp) / "tiny", "tiny", seed=0)
        folder = make_scalar_folder(body, Path(tmp) / "rm", seed=0)
        seqs = sequences(folder, args.calls)
        times: dict[str, list[float]] = {"batched": [], "one per request": []}
        with rewards.RewardPool(f"model:{folder}", num_workers=1, timeout_s=120) as pool:
            asyncio.run(score_all(pool, seqs[:8]))  # the worker loads the model first
            for _ in range(args.rounds):  # alternate, so drift hits both alike
                times["batched"].append(asyncio.run(score_all(pool, seqs)))
                default = rewards.BATCH_MAX
                rewards.BATCH_MAX = 1
                try:
                    times["one per request"].append(asyncio.run(score_all(pool, seqs)))
                finally:
                    rewards.BATCH_MAX = default
    rates = {k: args.calls / statistics.median(v) for k, v in times.items()}
    for name, rate in rates.items():
        print(f"{name:16s} {rate:8.1f} calls/s")
    print(f"batched / one per request: {rates['batched'] / rates['one per request']:.2f}x")


if __name__ == "__main__":
    main()

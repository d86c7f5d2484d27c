"""Evaluation during training (`eval.freq_steps`): when the servers hold weights vK with K a
multiple of freq_steps, the eval prompts (eval.dataset, or prompts held out of the
training data: `eval.holdout`) are each sampled `eval.n_samples` times with `eval.gconfig`
and scored by `eval.reward`, and one row goes to RUN/metrics.jsonl:

  {"kind": "eval", "step": K, "weight_version": K, "eval_reward_mean": ...,
   "eval_accuracy": ..., "eval_pass@k": ..., "eval_prompts": ..., "eval_samples": ...,
   "eval_gen_tokens": ..., "eval_s": ...}

Against the current weights: the evaluation holds the loop's weights lock, so no newer
version loads until its samples are done (the trainer and the rollouts go on meanwhile;
the next load waits at most one evaluation). Its requests go through their own client, so
the rollouts' gen_tokens and gen_tokens_per_s do not count them.

Exactly once: a version with an eval row is not evaluated again. A resumed run forgets the
rows of the steps it redoes with the rest of their metrics (rundir.layout.trim_after), so
each redone version is evaluated once, on its new weights; a version whose evaluation was
cut short by a crash has no row and is evaluated when the servers next hold it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.rollout import passk
from areal_cli.rollout.state import LoopState, StepSink
from areal_cli.rollout.workflows import EpisodeClient, Turn
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.records import EVAL_KIND, is_eval_row

if TYPE_CHECKING:
    from areal_cli.config.schema import EvalConfig
    from areal_cli.data.prompts import Prompt
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.rewards import RewardPool

CONCURRENCY = 64


def eval_rows(path: Path) -> dict[int, dict[str, Any]]:
    """The eval rows of a metrics file, by step."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line)
    return {row["step"]: row for row in rows if is_eval_row(row)}


async def sample_and_score(
    client: InferenceClient,
    tokenizer: Any,
    cfg: EvalConfig,
    rewards: RewardPool,
    prompt: Prompt,
    sample: int,
) -> tuple[Turn, Any]:
    """Sample `prompt` once (its `sample`-th sample, seeded from `cfg.seed`, so the same
    settings draw the same answers) with `cfg.gconfig`, and score it: the answer's turn
    and its reward result. `areal eval` and evaluation during training both sample so."""
    seed = (cfg.seed * 1_000_003 + prompt.index * 1009 + sample) % (2**31)
    episode = EpisodeClient(client, tokenizer, cfg.gconfig, rewards, seed)
    turn = await episode.generate(prompt.input_ids)
    result = await episode.reward(
        turn.text,
        {"answer": prompt.answer, "row": prompt.row},
        list(prompt.input_ids) + list(turn.output_ids),
    )
    return turn, result


def summarize(step: int, rewards: dict[int, list[float]], ks: list[int]) -> dict[str, Any]:
    """The eval row of version `step` from each prompt's sample rewards."""
    flat = [r for rs in rewards.values() for r in rs]
    correct = [[r >= passk.CORRECT_AT for r in rs] for rs in rewards.values()]
    figures = passk.summarize(correct, ks)
    row: dict[str, Any] = {
        "kind": EVAL_KIND,
        "step": step,
        "weight_version": step,
        "eval_reward_mean": sum(flat) / len(flat),
        "eval_accuracy": figures.pop("accuracy"),
        "eval_prompts": len(rewards),
        "eval_samples": len(flat),
    }
    row.update({f"eval_{name}": value for name, value in figures.items()})
    return row


@dataclass
class Evaluator:
    """Evaluates the versions `eval.freq_steps` names on the run's servers."""

    cfg: EvalConfig
    freq_steps: int
    prompts: list[Prompt]
    client: InferenceClient  # its own (InferenceClient.sibling): counted apart
    tokenizer: Any
    rewards: RewardPool
    metrics: Path
    done: set[int] = field(default_factory=set)
    busy: bool = False

    def due(self, version: int) -> bool:
        return version > 0 and version % self.freq_steps == 0 and version not in self.done

    async def evaluate(self, version: int) -> dict[str, Any]:
        """Sample and score every eval prompt on the servers' current weights."""
        start, tokens0 = time.perf_counter(), self.client.generated_tokens
        semaphore = asyncio.Semaphore(CONCURRENCY)
        rewards: dict[int, list[float]] = {p.index: [] for p in self.prompts}

        async def one(prompt: Prompt, i: int) -> None:
            async with semaphore:
                _, result = await sample_and_score(
                    self.client, self.tokenizer, self.cfg, self.rewards, prompt, i
                )
                rewards[prompt.index].append(result.value)

        samples = range(self.cfg.n_samples)
        await asyncio.gather(*(one(p, i) for p in self.prompts for i in samples))
        row = summarize(version, rewards, list(self.cfg.k))
        row["eval_gen_tokens"] = float(self.client.generated_tokens - tokens0)
        row["eval_s"] = time.perf_counter() - start
        row["time"] = time.time()
        return row

    async def settled(self, state: LoopState, poll_s: float = 0.05) -> None:
        """Until the version the servers hold is evaluated, if it is due (the end of a run:
        its last evaluation is not cut short)."""
        while self.busy or self.due(state.version):
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        self.rewards.close()
        await self.client.close()

    def write(self, row: dict[str, Any]) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.done.add(row["step"])


async def eval_task(evaluator: Evaluator, state: LoopState, sink: StepSink) -> None:
    """Evaluate each due version while the servers hold it, for ever (the loop cancels it)."""
    while True:
        if evaluator.due(state.version):
            async with state.weights_lock:  # no newer version loads meanwhile
                version = state.version
                if evaluator.due(version):
                    sink.status(f"evaluating v{version} on {len(evaluator.prompts)} prompts")
                    evaluator.busy = True
                    try:
                        row = await evaluator.evaluate(version)
                        evaluator.write(row)
                    finally:
                        evaluator.busy = False
                    sink.status(
                        f"eval v{version}: accuracy {row['eval_accuracy']:.3f} "
                        f"over {row['eval_samples']} samples"
                    )
        state.version_changed.clear()
        if not evaluator.due(state.version):
            await state.version_changed.wait()


def make_evaluator(
    cfg: Any,
    run_dir: Path,
    client: InferenceClient,
    tokenizer: Any,
    prompts: list[Prompt],
    recipe_dir: Path,
) -> Evaluator | None:
    """The run's evaluator, or None when eval.freq_steps is 0 (or there are no prompts)."""
    from areal_cli.rollout.rewards import RewardPool

    if not cfg.eval.freq_steps or not prompts:
        return None
    metrics = RunDir(run_dir).metrics
    return Evaluator(
        cfg.eval,
        cfg.eval.freq_steps,
        prompts,
        client.sibling(),
        tokenizer,
        RewardPool.from_config(cfg.eval.reward, recipe_dir),
        metrics,
        set(eval_rows(metrics)),
    )

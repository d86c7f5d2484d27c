"""`areal eval`: score a model or checkpoint on the recipe's `eval` section.

Setup: resolve the checkpoint (an HF folder; a run directory, meaning its newest
weights/vN; or a DCP recover entry, converted into a temporary HF folder), start the
recipe's inference servers on it, load the eval dataset.
Loop: `eval.n_samples` samples per prompt, each with a seed derived from `eval.seed`, the
prompt index and the sample index, so results do not depend on scheduling. Each finished
sample is appended to OUT/samples.jsonl at once; a rerun into the same OUT skips the
(prompt, sample) pairs already there.
Cleanup: OUT/summary.json (n_prompts, mean_reward, accuracy, pass@k, timing), a table,
and every server stopped. A sample counts as correct when its reward is >= 0.5.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from areal_cli.config.loader import LoadedConfig
from areal_cli.launch.local import ChildFailed, LocalRunner
from areal_cli.launch.plan import LaunchPlan
from areal_cli.rundir import handoff
from areal_cli.rundir.layout import run_dir_of

CORRECT_AT = 0.5


class EvalInputError(ValueError):
    """A checkpoint or output folder that cannot be used (exit code 2)."""


def resolve_checkpoint(cfg: Any, checkpoint: Path | None, scratch: Path) -> tuple[Path, str]:
    """An HF folder to serve, and a short name for it (used for the default OUT)."""
    if checkpoint is None:
        if cfg.model.path.startswith("builtin:"):
            from areal_cli.models.builtin import materialize
            from areal_cli.rollout.rewards import numeric

            built = run_dir_of(cfg) / "model"
            built.parent.mkdir(parents=True, exist_ok=True)
            name = cfg.model.path.split(":", 1)[1]
            return materialize(name, cfg.model.seed, built, numeric), "initial"
        return Path(cfg.model.path), "initial"
    if not checkpoint.exists():
        raise EvalInputError(f"checkpoint not found: {checkpoint}")
    if (checkpoint / "config.json").is_file():
        return checkpoint, checkpoint.name
    if (checkpoint / "weights").is_dir():
        entry = handoff.latest(checkpoint / "weights", "v")
        if entry is None:
            raise EvalInputError(f"run directory {checkpoint} has no finished weights/vN yet")
        return entry.path, entry.path.name
    from areal_cli.weights.convert import ConvertError, convert, detect

    try:
        if detect(checkpoint).kind == "dcp":
            out = scratch / "converted"
            convert(
                checkpoint,
                out,
                to="hf",
                dtype=None,
                max_shard_size="100GB",
                force=True,
                model_config=None,
            )
            return out, checkpoint.name
    except ConvertError as exc:
        raise EvalInputError(str(exc)) from exc
    raise EvalInputError(f"{checkpoint} is not an HF folder, a run directory or a DCP checkpoint")


def eval_plan(plan: LaunchPlan, model_dir: Path, out: Path) -> LaunchPlan:
    """The recipe's inference servers only, serving `model_dir`, logging into OUT/logs."""
    servers = []
    for proc in plan.processes:
        if not proc.role.startswith("inference"):
            continue
        argv = list(proc.argv)
        argv[argv.index("--model-path") + 1] = str(model_dir)
        servers.append(replace(proc, argv=argv, log=str(out / "logs" / f"{proc.name}.log")))
    return replace(plan, processes=servers)


def _done_samples(path: Path) -> dict[tuple[int, int], dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[(row["prompt_index"], row["sample_index"])] = row
    return done


async def _score_all(
    cfg: Any, loaded: LoadedConfig, plan: LaunchPlan, runner: LocalRunner, out: Path, progress: Any
) -> list[dict]:
    from transformers import AutoTokenizer

    from areal_cli.config.schema import GenerationHyperparameters
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.data import load_prompts, prepare_prompts
    from areal_cli.rollout.rewards import RewardPool
    from areal_cli.rollout.workflows import EpisodeClient

    ev = cfg.eval
    addresses = [f"http://127.0.0.1:{p.ports[0]}" for p in plan.processes]
    client = InferenceClient(
        addresses,
        api_key=cfg.inference.api_key,
        timeout_s=cfg.rollout.request_timeout_s,
        retries=cfg.rollout.request_retries,
        logs={a: p.log for a, p in zip(addresses, plan.processes, strict=True)},
    )
    rewards = RewardPool.from_config(ev.reward, loaded.recipe.resolve().parent)
    samples_file = out / "samples.jsonl"
    done = _done_samples(samples_file)
    try:
        await client.wait_healthy(cfg.launcher.startup_timeout_s, on_poll=lambda _: runner.check())
        model_dir = Path(plan.processes[0].argv[plan.processes[0].argv.index("--model-path") + 1])
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
        prompts, _ = prepare_prompts(tokenizer, load_prompts(ev.dataset), ev.dataset)
        if ev.max_prompts:
            prompts = prompts[: ev.max_prompts]
        gconfig: GenerationHyperparameters = ev.gconfig
        todo = [(p, i) for p in prompts for i in range(ev.n_samples) if (p.index, i) not in done]
        progress.start(len(prompts) * ev.n_samples, len(prompts) * ev.n_samples - len(todo))
        semaphore = asyncio.Semaphore(64)

        async def one(prompt: Any, i: int) -> None:
            async with semaphore:
                seed = (ev.seed * 1_000_003 + prompt.index * 1009 + i) % (2**31)
                episode = EpisodeClient(client, tokenizer, gconfig, rewards, seed)
                turn = await episode.generate(prompt.input_ids)
                result = await episode.reward(
                    turn.text, {"answer": prompt.answer, "row": prompt.row}
                )
                row = {
                    "prompt_index": prompt.index,
                    "sample_index": i,
                    "prompt": prompt.row.get(ev.dataset.prompt_key),
                    "answer": prompt.answer,
                    "completion": turn.text,
                    "reward": result.value,
                    "reward_error": result.error,
                    "tokens": len(turn.output_ids),
                }
                with open(samples_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
                done[(prompt.index, i)] = row
                progress.advance()

        await asyncio.gather(*(one(p, i) for p, i in todo))
        wanted = {(p.index, i) for p in prompts for i in range(ev.n_samples)}
        return [done[key] for key in sorted(wanted)]
    finally:
        rewards.close()
        await client.close()


def summarize_rows(rows: list[dict], ks: list[int], elapsed_s: float) -> dict[str, Any]:
    """summary.json: counts, mean reward, accuracy, pass@k and timing."""
    from areal_cli.evaluation.passk import summarize

    by_prompt: dict[int, list[bool]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_index"], []).append(row["reward"] >= CORRECT_AT)
    summary = {
        "n_prompts": len(by_prompt),
        "n_samples": len(rows),
        "mean_reward": sum(r["reward"] for r in rows) / max(len(rows), 1),
        **summarize(list(by_prompt.values()), ks),
        "generated_tokens": sum(r["tokens"] for r in rows),
        "elapsed_s": elapsed_s,
    }
    return summary


def run_eval(
    loaded: LoadedConfig, plan: LaunchPlan, checkpoint: Path | None, out: Path | None, progress: Any
) -> dict[str, Any]:
    """Evaluate; returns the summary (also written to OUT/summary.json)."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    cfg = loaded.config
    scratch = Path(tempfile.mkdtemp(prefix="areal-eval-"))
    runner = LocalRunner()
    try:
        model_dir, name = resolve_checkpoint(cfg, checkpoint, scratch)
        out = out or run_dir_of(cfg) / "eval" / name
        out.mkdir(parents=True, exist_ok=True)
        served = eval_plan(plan, model_dir, out)
        start = time.perf_counter()
        for spec in served.processes:
            runner.start(spec)
        rows = asyncio.run(_score_all(cfg, loaded, served, runner, out, progress))
        summary = summarize_rows(rows, cfg.eval.k, time.perf_counter() - start)
        summary["checkpoint"] = str(model_dir if checkpoint is None else checkpoint)
        handoff.write_json_atomic(out / "summary.json", summary)
        summary["out"] = str(out)
        return summary
    except ChildFailed as exc:
        raise RuntimeError(f"{exc}\n{exc.tail}") from exc
    finally:
        runner.stop_all()
        progress.stop()
        shutil.rmtree(scratch, ignore_errors=True)

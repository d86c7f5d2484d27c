"""`areal eval`: score a model or checkpoint on the recipe's `eval` section.

Setup: resolve the checkpoint (an HF folder; a run directory, meaning its newest
weights/vN; or a DCP recover entry, converted into a temporary HF folder), start the
recipe's inference servers on it, load the eval dataset.
Identity: OUT/eval.json records a hash of the weights (from a handoff manifest, or the
CRC-32 of the files) and of every setting that changes a sample (dataset, reward,
sampling, n_samples, max_prompts, seed). The default OUT is named after the checkpoint
and that key: RUN/eval/vN-KEY for a checkpoint of a run, FILEROOT/EXPERIMENT/eval/NAME-KEY
for the initial model or a folder of no run (no run folder is created for those). An OUT
that holds another model's or other settings' samples is refused (exit 2), never mixed.
Loop: `eval.n_samples` samples per prompt, each with a seed derived from `eval.seed`, the
prompt index and the sample index, so results do not depend on scheduling. Each finished
sample is appended to OUT/samples.jsonl at once; a rerun of the same eval into the same
OUT skips the (prompt, sample) pairs already there.
Cleanup: OUT/summary.json (n_prompts, mean_reward, accuracy, pass@k, timing), a table,
and every server stopped. A sample counts as correct when its reward is >= 0.5.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from areal_cli.config.loader import LoadedConfig
from areal_cli.launch.local import ChildFailed, LocalRunner
from areal_cli.launch.plan import LaunchPlan
from areal_cli.rundir import handoff
from areal_cli.rundir.checkpoints import CheckpointError, locate
from areal_cli.rundir.layout import run_dir_of
from areal_cli.rundir.paths import RunDir

EVAL_FILE = "eval.json"  # the identity of the model and settings whose samples OUT holds
SAMPLES_FILE = "samples.jsonl"


class EvalInputError(ValueError):
    """A checkpoint or output folder that cannot be used (exit code 2)."""


@dataclass(frozen=True)
class Checkpoint:
    """What an eval serves: an HF folder, a short name, the run it belongs to (if any)
    and the folder whose content identifies the weights (a DCP entry for a conversion)."""

    model_dir: Path
    name: str
    run_dir: Path | None
    identity_source: Path


def resolve_checkpoint(cfg: Any, checkpoint: Path | None, scratch: Path) -> Checkpoint:
    """The HF folder to serve for `--checkpoint` (or the recipe's initial model)."""
    if checkpoint is None:
        if cfg.model.path.startswith("builtin:"):
            from areal_cli.launch import builtins

            # Served from the cache: an eval of the initial model creates no run folder.
            say = lambda line: print(f"[areal] {line}", flush=True)  # noqa: E731
            built = builtins.cached(cfg.model.path, cfg.model.seed, say)
            return Checkpoint(built, "initial", None, built)
        path = Path(cfg.model.path)
        return Checkpoint(path, "initial", None, path)
    try:
        found = locate(checkpoint)
    except CheckpointError as exc:
        raise EvalInputError(str(exc)) from None
    if found.kind == "hf":
        return Checkpoint(found.path, found.path.name, found.run_dir, found.path)
    from areal_cli.weights.convert import ConvertError, convert, merge_lora

    out = scratch / "converted"
    if found.kind == "lora":  # merged into its base: every backend serves that
        try:
            merge_lora(
                found.path, out, dtype=None, max_shard_size="100GB", force=True, model_config=None
            )
        except ConvertError as exc:
            raise EvalInputError(f"{found.path}: {exc}") from exc
        return Checkpoint(out, found.path.name, found.run_dir, found.path)
    try:
        convert(
            found.path,
            out,
            to="hf",
            dtype=None,
            max_shard_size="100GB",
            force=True,
            model_config=None,
        )
    except ConvertError as exc:
        raise EvalInputError(f"{found.path}: {exc}") from exc
    return Checkpoint(out, found.path.name, found.run_dir, found.path)


# ------------------------------------------------------------------ what was evaluated

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_fingerprint(folder: Path) -> str:
    """A hash of the weights' content. A handoff entry (weights/vN, recover/step-N) has
    the CRC-32 of every file in its manifest; for any other folder the CRC-32 of its
    weights files and config.json is computed (ISA-L: about a second per few GB)."""
    if (folder / handoff.MANIFEST).is_file():
        files = handoff.read_entry(folder).manifest["files"]
        items = sorted((f["name"], f["size"], f["crc32"]) for f in files)
    else:
        names = sorted(
            p.name
            for p in folder.iterdir()
            if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"
        )
        records = [handoff.record_file(folder, n) for n in names]
        items = [(r.name, r.size, r.crc32) for r in records]
    if not items:
        raise EvalInputError(f"{folder} holds no weights files")
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def eval_identity(cfg: Any, checkpoint: Checkpoint) -> dict[str, Any]:
    """What makes two evals' samples interchangeable: the weights and every setting that
    changes a sample or its score. Its `key` names the default output folder."""
    ev = cfg.eval
    settings = {
        "dataset": dataclasses.asdict(ev.dataset),
        "reward": dataclasses.asdict(ev.reward),
        "sampling": ev.gconfig.sampling_params(),
        "n_samples": ev.n_samples,
        "max_prompts": ev.max_prompts,
        "seed": ev.seed,
        "tokenizer_path": cfg.model.tokenizer_path,
    }
    model = model_fingerprint(checkpoint.identity_source)
    key = hashlib.sha256(json.dumps([model, settings], sort_keys=True).encode()).hexdigest()
    return {
        "key": key[:12],
        "model": model,
        "source": str(checkpoint.identity_source),
        "settings": settings,
    }


def default_out(cfg: Any, checkpoint: Checkpoint, key: str) -> Path:
    """RUN/eval/NAME-KEY for a checkpoint of a run; FILEROOT/EXPERIMENT/eval/NAME-KEY for
    the initial model or a folder of no run (no run folder is created for it)."""
    base = checkpoint.run_dir or run_dir_of(cfg).parent
    return RunDir(base).eval / f"{checkpoint.name}-{key}"


def claim_out(out: Path, identity: dict[str, Any]) -> None:
    """Make OUT this eval's, or refuse (exit 2) when it holds another eval's samples."""
    marker = out / EVAL_FILE
    if marker.is_file():
        theirs = json.loads(marker.read_text())
        if theirs.get("key") == identity["key"]:
            return
        what = "model" if theirs.get("model") != identity["model"] else "eval settings"
        raise EvalInputError(
            f"{out} holds samples of another {what} ({theirs.get('source')}); they cannot be "
            "mixed with this eval's: give another --out, or delete that folder"
        )
    if (out / SAMPLES_FILE).exists():
        raise EvalInputError(
            f"{out} holds samples of an unknown model (no {EVAL_FILE}); give another --out, "
            "or delete that folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    handoff.write_json_atomic(marker, identity)


def eval_plan(plan: LaunchPlan, model_dir: Path, out: Path) -> LaunchPlan:
    """The recipe's inference servers only, serving `model_dir`, logging into OUT/logs."""
    servers = []
    for proc in plan.processes:
        if not proc.role.startswith("inference"):
            continue
        argv = list(proc.argv)
        flag = "--model" if "--model" in argv else "--model-path"  # vLLM's, or SGLang's
        argv[argv.index(flag) + 1] = str(model_dir)
        if "--watch-weights" in argv:  # no weights are published in an eval: watch no run
            at = argv.index("--watch-weights")
            del argv[at : at + 2]
        log = RunDir(out).log(proc.name)  # an eval's folder keeps its logs as a run does
        servers.append(replace(proc, argv=argv, log=str(log)))
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
    cfg: Any,
    loaded: LoadedConfig,
    plan: LaunchPlan,
    runner: LocalRunner,
    out: Path,
    progress: Any,
    tokenizer: Any,
    prompts: list,
) -> list[dict]:
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.evaluation import sample_and_score
    from areal_cli.rollout.rewards import RewardPool

    ev = cfg.eval
    addresses = [f"http://127.0.0.1:{p.ports[0]}" for p in plan.processes]
    client = InferenceClient(
        addresses,
        api_key=cfg.inference.api_key,
        timeout_s=cfg.rollout.request_timeout_s,
        retries=cfg.rollout.request_retries,
        logs={a: p.log for a, p in zip(addresses, plan.processes, strict=True)},
        backend=plan.backend,
        served_model=plan.served_model,
    )
    rewards = RewardPool.from_config(ev.reward, loaded.recipe.resolve().parent)
    samples_file = out / SAMPLES_FILE
    done = _done_samples(samples_file)
    try:
        await client.wait_healthy(cfg.launcher.startup_timeout_s, on_poll=lambda _: runner.check())
        todo = [(p, i) for p in prompts for i in range(ev.n_samples) if (p.index, i) not in done]
        progress.start(len(prompts) * ev.n_samples, len(prompts) * ev.n_samples - len(todo))
        semaphore = asyncio.Semaphore(64)

        async def one(prompt: Any, i: int) -> None:
            async with semaphore:
                turn, result = await sample_and_score(client, tokenizer, ev, rewards, prompt, i)
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
    from areal_cli.rollout.passk import CORRECT_AT, summarize

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
    from transformers.utils import logging as hf_logging

    from areal_cli.data.prompts import DatasetError, load_dataset_prompts
    from areal_cli.data.tokenizer import load_tokenizer

    hf_logging.disable_progress_bar()
    cfg = loaded.config
    scratch = Path(tempfile.mkdtemp(prefix="areal-eval-"))
    runner = LocalRunner()
    try:
        chosen = resolve_checkpoint(cfg, checkpoint, scratch)
        tokenizer = load_tokenizer(cfg.model.tokenizer_path or chosen.model_dir)
        try:  # before any process starts: a bad row under on_bad_row: error is exit 2
            prompts = load_dataset_prompts(
                tokenizer, cfg.eval.dataset, progress.warn, key="eval.dataset"
            )
        except DatasetError as exc:
            raise EvalInputError(f"eval.dataset: {exc}") from None
        if cfg.eval.max_prompts:
            prompts = prompts[: cfg.eval.max_prompts]
        identity = eval_identity(cfg, chosen)
        out = out or default_out(cfg, chosen, identity["key"])
        claim_out(out, identity)
        served = eval_plan(plan, chosen.model_dir, out)
        start = time.perf_counter()
        for spec in served.processes:
            runner.start(spec)
        rows = asyncio.run(
            _score_all(cfg, loaded, served, runner, out, progress, tokenizer, prompts)
        )
        summary = summarize_rows(rows, cfg.eval.k, time.perf_counter() - start)
        summary["checkpoint"] = str(chosen.model_dir if checkpoint is None else checkpoint)
        summary["model_fingerprint"] = identity["model"]
        handoff.write_json_atomic(out / "summary.json", summary)
        summary["out"] = str(out)
        return summary
    except ChildFailed as exc:
        raise RuntimeError(f"{exc}\n{exc.tail}") from exc
    finally:
        runner.stop_all()
        progress.stop()
        shutil.rmtree(scratch, ignore_errors=True)

"""What this machine knows of a model before anything starts: its config.json (a local
folder, or a builtin's from BUILTIN_ARCHITECTURES), whether a Hub id is in the local
cache, and whether its heads split over a trainer layout. No torch, no network."""

from __future__ import annotations

import json
from pathlib import Path

from areal_cli.config.schema import BUILTIN_ARCHITECTURES, TP_MODEL_TYPES


def parallel_problem(config: dict, tp: int, cp: int = 1) -> str:
    """Why a model (its config.json as a dict) cannot be split over `tp` tensor-parallel
    and `cp` context-parallel ranks, or ''. Tensor parallelism needs a plan for the
    architecture and splits the heads; Ulysses context parallelism then splits each tp
    rank's heads again."""
    heads = config.get("num_attention_heads", 0)
    kv_heads = config.get("num_key_value_heads") or heads
    if tp > 1:
        model_type = config.get("model_type", "?")
        if model_type not in TP_MODEL_TYPES:
            return (
                f"the trainer has no tensor-parallel plan for model_type '{model_type}' "
                f"(supported: {', '.join(TP_MODEL_TYPES)})"
            )
        if heads % tp or kv_heads % tp:
            return f"t{tp} does not divide the model's {heads} attention and {kv_heads} key/value heads"
    if cp > 1 and ((heads // tp) % cp or (kv_heads // tp) % cp):
        return (
            f"c{cp} does not divide the {heads // tp} attention and {kv_heads // tp} key/value "
            f"heads of each tensor-parallel rank (t{tp})"
        )
    return ""


def model_config(path: str) -> dict | None:
    """The model's config.json as a dict (a builtin's from BUILTIN_ARCHITECTURES), or None
    when it is not on this machine."""
    if path.startswith("builtin:"):
        return BUILTIN_ARCHITECTURES.get(path.split(":", 1)[1])
    config_file = Path(path) / "config.json"
    try:
        return json.loads(config_file.read_text()) if config_file.is_file() else None
    except (OSError, ValueError):
        return None


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The snapshot folder that the local Hugging Face cache's refs/main points to for
    `repo_id` (HF_HOME / HF_HUB_CACHE honoured), or None when it is not cached. Asks
    huggingface_hub's cache API with local_files_only, so it never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


# A reward model as a recipe's reward: reward.fn: model:PATH (areal_cli.rollout.reward_model)
REWARD_MODEL_PREFIX = "model:"


def is_scalar_config(config: dict) -> bool:
    """A sequence-classification config: a scalar head (areal_cli.models.scalar_head)."""
    return (config.get("architectures") or [""])[0].endswith("ForSequenceClassification")


def reward_model_path(spec: str, recipe_dir: Path | None) -> Path:
    """The folder of a `model:PATH` spec, relative paths from the recipe's folder."""
    path = Path(spec[len(REWARD_MODEL_PREFIX) :]).expanduser()
    if not path.is_absolute() and recipe_dir is not None:
        path = recipe_dir / path
    return path


def reward_model_problem(path: Path) -> str | None:
    """Why PATH cannot serve as a reward model, or None when it can."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return f"{path} is not a model folder (no config.json)"
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        return f"{config_file} is not valid JSON: {exc}"
    if not is_scalar_config(config) or config.get("num_labels", 1) != 1:
        return f"{path} is not a reward model (a one-label *ForSequenceClassification folder)"
    if not any(path.glob("*.safetensors")):
        return f"{path} holds no .safetensors weights"
    return None

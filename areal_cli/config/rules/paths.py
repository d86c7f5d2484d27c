"""What must exist on this machine: the model and its tokenizer (a folder, a cached Hub
id or a builtin), and the datasets. A plan (validate, --dry-run) only warns where a real
run needs files this machine lacks."""

from __future__ import annotations

import json
from pathlib import Path

from areal_cli.config.checker import Checker
from areal_cli.config.errors import PATH_RULE
from areal_cli.config.loader import is_hub_id
from areal_cli.config.model_info import cached_snapshot
from areal_cli.config.schema import BUILTIN_MODELS


def check_model(c: Checker, launch: bool) -> None:
    path = c.cfg.model.path
    if not path:
        c.error("model.path", "is required", "give a Hugging Face model folder or builtin:tiny")
        return
    if path.startswith("builtin:"):
        _check_builtin(c, "model.path", path)
        return
    model_dir = _local_or_cached(c, "model.path", path, launch, "model")
    if model_dir is None:
        return
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        c.error(
            "model.path",
            f"{path} has no config.json, so it is not a Hugging Face model folder",
            "point it at the folder that holds config.json and the safetensors files",
        )
        return
    tokenizer = c.cfg.model.tokenizer_path or path
    tok_dir = (
        _local_or_cached(c, "model.tokenizer_path", tokenizer, launch, "tokenizer")
        if tokenizer != path
        else model_dir
    )
    if tok_dir is not None:
        _check_tokenizer_fits(c, config_file, tok_dir)


def _check_builtin(c: Checker, key: str, path: str) -> bool:
    """`path` (builtin:NAME) names a builtin model; an error at `key` otherwise."""
    name = path.split(":", 1)[1]
    if name not in BUILTIN_MODELS:
        c.error(
            key,
            f"unknown builtin model '{name}'",
            f"use one of: {', '.join('builtin:' + m for m in BUILTIN_MODELS)}",
        )
    return name in BUILTIN_MODELS


def check_teacher(c: Checker, launch: bool) -> None:
    """teacher.path (on-policy distillation): a builtin or a model folder with the
    student's vocabulary, since its logprobs score the student's tokens."""
    from areal_cli.config.model_info import model_config

    t = c.cfg.teacher
    if not t.path:
        for key in ("rl_loss_weight", "distill_loss_weight"):
            if ("teacher", key) in c.loaded.locations:
                c.warn(
                    f"teacher.{key}",
                    "is not read without teacher.path",
                    "set teacher.path, or remove it",
                )
        return
    if t.rl_loss_weight == 0 and t.distill_loss_weight == 0:
        c.error(
            "teacher.distill_loss_weight",
            "and teacher.rl_loss_weight are both 0, so nothing trains",
            "raise one of them",
        )
    if t.path.startswith("builtin:"):
        if not _check_builtin(c, "teacher.path", t.path):
            return
    elif _local_or_cached(c, "teacher.path", t.path, launch, "teacher model") is None:
        return
    elif not (Path(t.path) / "config.json").is_file():
        c.error(
            "teacher.path",
            f"{t.path} has no config.json, so it is not a Hugging Face model folder",
            "point it at a checkpoint folder (RUN/checkpoints/step-N)",
        )
        return
    student, teacher = model_config(c.cfg.model.path), model_config(t.path)
    if student and teacher and student.get("vocab_size") != teacher.get("vocab_size"):
        c.error(
            "teacher.path",
            f"has vocab_size {teacher.get('vocab_size')} but the student ({c.cfg.model.path}) {student.get('vocab_size')}: the teacher must score the student's tokens",
            "use a teacher with the student's tokenizer",
        )


def _local_or_cached(c: Checker, key: str, value: str, launch: bool, what: str) -> Path | None:
    """A local folder for `value`, or None (after an error, or a warning for hub ids)."""
    if Path(value).exists():
        return Path(value)
    if is_hub_id(value):
        repo_type = "dataset" if what == "dataset" else "model"
        cached = cached_snapshot(value, repo_type)
        if cached is not None:
            return cached
        message = (
            f"'{value}' is not in the local Hugging Face cache (areal never downloads at run time)"
        )
        flag = "--repo-type dataset " if what == "dataset" else ""
        fix = f"download it first with `hf download {flag}{value}`, or give a local folder"
        (c.error if launch else c.warn)(key, message, fix)
        return None
    fix = f"check the path ({PATH_RULE})"
    if what == "dataset" or launch:
        c.error(key, f"{what} path does not exist: {value}", fix)
    else:  # a plan needs no weights (DESIGN §1); a real run refuses to start without them
        c.warn(key, f"{what} path does not exist yet: {value}; a real run needs it", fix)
    return None


def _check_tokenizer_fits(c: Checker, config_file: Path, tok_dir: Path) -> None:
    """The tokenizer must not produce ids beyond the model's embedding table."""
    tok_file = tok_dir / "tokenizer.json"
    try:
        vocab_size = json.loads(config_file.read_text()).get("vocab_size")
        if not tok_file.is_file() or not isinstance(vocab_size, int):
            return
        tok = json.loads(tok_file.read_text())
    except (OSError, ValueError):
        c.error(
            "model.path",
            f"cannot read {config_file} or {tok_file} as JSON",
            "re-save the model with save_pretrained",
        )
        return
    ids = (
        list((tok.get("model") or {}).get("vocab", {}).values())
        if isinstance((tok.get("model") or {}).get("vocab"), dict)
        else []
    )
    ids += [t.get("id", 0) for t in tok.get("added_tokens", [])]
    largest = max(ids, default=-1)
    if largest >= vocab_size:
        c.error(
            "model.tokenizer_path",
            f"the tokenizer produces token id {largest} but the model embeds only {vocab_size} tokens",
            "use the tokenizer that was saved with this model",
        )


def check_dataset(c: Checker, key: str, path: str, launch: bool, *, required: bool) -> None:
    if not path:
        if required:
            c.error(f"{key}.path", "is required", "give a .jsonl or .parquet file")
        return
    dtype = c.cfg.eval.dataset.type if key == "eval.dataset" else c.cfg.dataset.type
    if Path(path).exists():
        suffix = Path(path).suffix
        if (
            dtype == "auto"
            and suffix not in (".jsonl", ".json", ".parquet")
            and not Path(path).is_dir()
        ):
            c.error(
                _path_key(key),
                f"cannot tell the format of '{Path(path).name}' from its extension",
                f"set {'dataset' if key.endswith('_path') else key}.type to jsonl or parquet",
            )
        return
    _local_or_cached(c, _path_key(key), path, launch, "dataset")


def _path_key(key: str) -> str:
    """The recipe key of a dataset's path: SECTION.path, or the key itself (sft.eval_path)."""
    return key if key.endswith("_path") else f"{key}.path"

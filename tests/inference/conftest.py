"""Shared fixtures: tiny model folders built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_cli.models.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "tiny" preset with seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed0", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_alt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as `tiny_model_dir`, different weights (seed 1)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1", "tiny", seed=1)

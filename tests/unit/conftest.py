"""Fixtures of the unit tests: the tiny model's tokenizer, built once per module."""

from __future__ import annotations

import pytest

from areal_cli.models.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0)
    )

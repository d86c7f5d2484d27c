"""The parrot model and an embedded server running it, for each agent-proxy test module
(tests/inference/parrot.py), and the tiny models as transformers loads them (the
reference the engine's outputs are held to)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.inference.parrot import teach
from tests.inference.test_server import Server, serve


@pytest.fixture(scope="module")
def parrot(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return teach(tiny_model_dir, tmp_path_factory.mktemp("parrot"))


@pytest.fixture(scope="module")
def server(parrot: Path) -> Iterator[Server]:
    yield from serve(
        parrot, "--served-model-name", "parrot", "--max-running-requests", "16",
        "--weight-version", "3",
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def hf_model_alt(tiny_model_dir_alt: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir_alt).eval()

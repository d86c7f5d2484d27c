"""Our safetensors reader and writers against the reference `safetensors` library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_cli.weights.safetensors_io import read_tensors, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "flag": torch.tensor([1, 0, 1], dtype=torch.int8),  # 3 bytes: what follows is unaligned
        "w": torch.randn(4, 5, generator=gen),
        "h": torch.randn(3, generator=gen).to(torch.bfloat16),
        "empty": torch.zeros(0, 2),
        "step": torch.tensor(7, dtype=torch.int64),
    }


def test_read_matches_the_reference_library_and_reuses_its_buffer(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    write_safetensors(tmp_path, "ours.safetensors", tensors)
    assert all(
        torch.equal(v, load_file(str(tmp_path / "ours.safetensors"))[k]) for k, v in tensors.items()
    )
    buffer = None
    for name in ("ref.safetensors", "ours.safetensors"):
        loaded, again = read_tensors(tmp_path / name, buffer)
        assert buffer is None or again is buffer or len(again) != len(buffer)
        buffer = again
        assert loaded.keys() == tensors.keys()
        for key, value in tensors.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:-5], "wrong size|outside the file"),
        (lambda raw: raw[:4], "truncated"),
        (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "does not fit"),
        (lambda raw: raw[:8] + b"x" + raw[9:], "not valid JSON"),
    ],
)
def test_damaged_files_raise_a_clear_error(tmp_path: Path, damage, message: str) -> None:
    save_file(_tensors(), str(tmp_path / "m.safetensors"))
    path = tmp_path / "m.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        read_tensors(path)

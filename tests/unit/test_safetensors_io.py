"""Our safetensors reader and writers against the reference `safetensors` library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_cli.rundir.safetensors_io import read_tensors, write_safetensors


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
    for name in ("ref.safetensors", "ours.safetensors"):
        loaded, _ = read_tensors(tmp_path / name)
        assert loaded.keys() == tensors.keys()
        for key, value in tensors.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    # A file of the same size is read into the buffer it is given, in place ...
    _, buffer = read_tensors(tmp_path / "ours.safetensors")
    write_safetensors(
        tmp_path,
        "plus1.safetensors",
        {k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()},
    )
    assert (tmp_path / "plus1.safetensors").stat().st_size == len(buffer)
    loaded, again = read_tensors(tmp_path / "plus1.safetensors", buffer)
    assert again is buffer
    assert torch.equal(loaded["w"], tensors["w"] + 1)
    # ... and one of another size gets a new buffer.
    write_safetensors(tmp_path, "bigger.safetensors", {**tensors, "more": torch.ones(8)})
    _, other = read_tensors(tmp_path / "bigger.safetensors", buffer)
    assert other is not buffer and len(other) != len(buffer)


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

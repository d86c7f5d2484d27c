"""The handoff protocol: only finished, intact entries are ever read."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from areal_cli.rundir import handoff
from areal_cli.rundir.batch import RolloutBatch, read_batch, write_batch


def _write(parent: Path, n: int, payload: bytes = b"abc") -> handoff.Entry:
    return handoff.write_entry(
        parent, f"v{n}", n, lambda d: [handoff.write_bytes(d, "w.bin", payload)], {"k": n}
    )


def test_write_then_read(tmp_path: Path) -> None:
    entry = _write(tmp_path, 3, b"hello")
    again = handoff.read_entry(tmp_path / "v3", verify_crc=True)
    assert again.version == 3 and again.meta == {"k": 3}
    assert again.manifest["files"] == [
        {"name": "w.bin", "size": 5, "crc32": entry.manifest["files"][0]["crc32"]}
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_unfinished_and_damaged_entries_are_refused(tmp_path: Path) -> None:
    (tmp_path / ".tmp-v9-dead").mkdir()  # a writer that crashed before renaming
    (tmp_path / "v8").mkdir()  # a directory without manifest
    _write(tmp_path, 1)
    _write(tmp_path, 2, b"12345")
    assert [e.version for e in handoff.list_entries(tmp_path, "v")] == [1, 2]
    (tmp_path / "v2" / "w.bin").write_bytes(b"12")  # truncated after the fact
    with pytest.raises(handoff.IncompleteEntry, match="has 2 bytes"):
        handoff.read_entry(tmp_path / "v2")
    (tmp_path / "v2" / "w.bin").write_bytes(b"12346")  # same size, corrupt content
    with pytest.raises(handoff.IncompleteEntry, match="CRC"):
        handoff.read_entry(tmp_path / "v2", verify_crc=True)
    assert handoff.latest(tmp_path, "v").version == 2  # size still matches without the CRC check
    (tmp_path / "v2" / "w.bin").unlink()
    assert handoff.latest(tmp_path, "v").version == 1
    assert sorted(handoff.remove_stale(tmp_path)) == [".tmp-v9-dead"]


def test_failed_writer_leaves_nothing(tmp_path: Path) -> None:
    def boom(d: Path) -> list:
        handoff.write_bytes(d, "partial.bin", b"x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        handoff.write_entry(tmp_path, "v1", 1, boom)
    assert list(tmp_path.iterdir()) == []


def test_gc_keeps_the_newest(tmp_path: Path) -> None:
    for n in (1, 2, 10, 3):
        _write(tmp_path, n)
    assert handoff.gc(tmp_path, "v", keep_last=2) == ["v1", "v2"]
    assert [e.path.name for e in handoff.list_entries(tmp_path, "v")] == ["v3", "v10"]


def test_rewrite_replaces_atomically(tmp_path: Path) -> None:
    _write(tmp_path, 1, b"old")
    _write(tmp_path, 1, b"newer")
    assert (tmp_path / "v1" / "w.bin").read_bytes() == b"newer"
    assert json.loads((tmp_path / "v1" / "manifest.json").read_text())["files"][0]["size"] == 5


def test_batch_round_trip(tmp_path: Path) -> None:
    seqs = [
        {
            "input_ids": torch.tensor([1, 2, 3]),
            "loss_mask": torch.tensor([0, 1, 1]),
            "logprobs": torch.tensor([0.0, -0.5, -1.0]),
            "versions": torch.tensor([-1, 0, 1]),
        },
        {
            "input_ids": torch.tensor([4, 5]),
            "loss_mask": torch.tensor([0, 1]),
            "logprobs": torch.tensor([0.0, -2.0]),
            "versions": torch.tensor([-1, 1]),
        },
    ]
    batch = RolloutBatch.from_sequences(seqs, [1.0, 0.0], group_size=2)
    entry = write_batch(tmp_path, 7, batch, {"note": "x"})
    back = read_batch(handoff.read_entry(entry.path, verify_crc=True))
    assert back.group_size == 2 and back.seqlens.tolist() == [3, 2]
    assert back.sequence(1)["logprobs"].tolist() == [0.0, -2.0]
    assert back.versions.tolist() == [-1, 0, 1, -1, 1]
    with pytest.raises(ValueError, match="groups of 3"):
        RolloutBatch.from_sequences(seqs, [1.0, 0.0], group_size=3)


def test_newest_after_skips_old_and_unfinished(tmp_path: Path) -> None:
    for n in (1, 2, 3):
        _write(tmp_path, n)
    (tmp_path / "v9").mkdir()  # unfinished: no manifest
    assert handoff.newest_after(tmp_path, "v", 1).version == 3
    assert handoff.newest_after(tmp_path, "v", 3) is None
    assert handoff.newest_after(tmp_path / "missing", "v", 0) is None


def test_crc32_combine_matches_zlib() -> None:
    import os

    for len_a, len_b in [(0, 0), (1, 0), (0, 7), (13, 1), (1000, 4097), (3, 1 << 20)]:
        a, b = os.urandom(len_a), os.urandom(len_b)
        combined = handoff.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
        assert combined == zlib.crc32(a + b)


def test_fast_crc32_is_zlibs_checksum() -> None:
    """Manifests must stay readable by any zlib: the ISA-L CRC gives the same values,
    also when continued from a running value and on memoryviews of tensors."""
    import os

    from areal_cli.rundir.safetensors_io import tensor_bytes

    for n in (0, 1, 63, 4097, (1 << 20) + 5):
        data = os.urandom(n)
        assert handoff.crc32(data) == zlib.crc32(data)
        assert handoff.crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)
    view = tensor_bytes(torch.arange(1000.0).reshape(10, 100)[3:7])
    assert handoff.crc32(view) == zlib.crc32(bytes(view))


def test_pieces_from_several_writers_make_one_checked_file(tmp_path: Path) -> None:
    from areal_cli.rundir.safetensors_io import PieceWriter, layout

    tensors = {"a": torch.arange(12.0).reshape(4, 3), "b": torch.arange(5, dtype=torch.int64)}
    header, starts, size = layout(tuple((k, v.dtype, tuple(v.shape)) for k, v in tensors.items()))
    path = tmp_path / "model.safetensors"
    pieces = [PieceWriter.create(path, header, size)]
    # Two "ranks": each writes its rows of `a`; the second also writes `b`.
    first, second = PieceWriter(path), PieceWriter(path)
    second.write(starts["a"] + 3 * 12, tensors["a"][3:])
    first.write(starts["a"], tensors["a"][:3])
    second.write(starts["b"], tensors["b"])
    record = handoff.combine_pieces(path.name, size, pieces + first.close() + second.close())
    data = path.read_bytes()
    assert record.size == len(data) == size
    assert record.crc32 == zlib.crc32(data)
    from safetensors.torch import load_file

    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="gap or overlap at byte"):
        handoff.combine_pieces(path.name, size, pieces + second.pieces)
    with pytest.raises(ValueError, match=f"cover {len(header) + 36} of {size} bytes"):
        handoff.combine_pieces(path.name, size, pieces + first.pieces)


def test_watcher_wakes_on_rename_and_times_out_without(tmp_path: Path) -> None:
    """Said by what wait returns (woken or timed out), not by the wall clock."""
    import asyncio
    import threading

    parent = tmp_path / "weights"
    watcher = handoff.Watcher(parent)  # creates the folder
    try:
        assert watcher.wait(0.05) is False  # nothing happens: the timeout
        threading.Timer(0.1, lambda: _write(parent, 1)).start()
        assert watcher.wait(60) is True  # woken by the rename, not by the 60 s timeout
        assert handoff.newest_after(parent, "v", 0) is not None

        async def wait_async() -> bool:
            asyncio.get_running_loop().call_later(0.1, _write, parent, 2)
            return await watcher.wait_async(60)

        assert asyncio.run(wait_async()) is True
        assert handoff.newest_after(parent, "v", 1).version == 2
        assert asyncio.run(watcher.wait_async(0.05)) is False
    finally:
        watcher.close()

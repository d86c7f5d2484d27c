"""Streaming safetensors writer: header first, then each tensor as it becomes available.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping
each name to its dtype, shape and byte range, then the raw little-endian bytes. Because
the header only needs shapes and dtypes, the file can be written while tensors are still
being gathered from other ranks: `StreamingWriter` writes on a background thread (file
writes and CRC-32 release the GIL), so gathering tensor i+1 overlaps writing tensor i, and
no second copy of the whole model is ever built in memory.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import zlib
from pathlib import Path

import torch

from areal_cli.weights.handoff import FileRecord

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def header_bytes(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The length prefix and JSON header for tensors of the given names, dtypes and shapes."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        n_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n_bytes],
        }
        offset += n_bytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
        flat = flat.view(torch.int16)
    return memoryview(flat.numpy()).cast("B")


class StreamingWriter:
    """Write one safetensors file from tensors handed over in header order.

    Usage: `w = StreamingWriter(dir, name, specs)`, then `w.put(tensor)` for each spec in
    order, then `record = w.close()` (fsynced file and its CRC-32).
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        depth: int = 2,
    ):
        self.directory, self.name, self.specs = directory, name, specs
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._size = 0
        self._crc = 0
        self._file = open(directory / name, "wb")  # noqa: SIM115 - closed in close()
        self._write(header_bytes(specs))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)

    def _run(self) -> None:
        while (tensor := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write(_as_bytes(tensor))
                except BaseException as exc:  # reported by close()
                    self._error = exc

    def put(self, tensor: torch.Tensor) -> None:
        """Queue the next tensor (blocks when `depth` tensors are already waiting)."""
        self._queue.put(tensor.detach().cpu())

    def close(self) -> FileRecord:
        """Finish writing, fsync, and return the file's record; re-raises writer errors."""
        self._queue.put(None)
        self._thread.join()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._error is not None:
            raise self._error
        return FileRecord(self.name, self._size, self._crc)


def write_safetensors(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """Write a dict of tensors as one safetensors file (streaming, fsynced)."""
    writer = StreamingWriter(
        directory, name, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    )
    for value in tensors.values():
        writer.put(value)
    return writer.close()

"""Streaming safetensors writer: header first, then each tensor as it becomes available.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping
each name to its dtype, shape and byte range, then the raw little-endian bytes. Because
the header only needs shapes and dtypes, the file can be written while tensors are still
being gathered from other ranks: `StreamingWriter` writes on a background thread (file
writes and CRC-32 release the GIL), so gathering tensor i+1 overlaps writing tensor i, and
no second copy of the whole model is ever built in memory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import threading
from pathlib import Path

import torch

from areal_cli.rundir.handoff import FileRecord, Piece, Writeback, crc32

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
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


@functools.lru_cache(maxsize=8)  # a trainer publishes the same layout every step
def layout(
    specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
) -> tuple[bytes, dict[str, int], int]:
    """The header (length prefix + JSON), each tensor's absolute byte offset in the file, and
    the file's total size, for tensors of the given names, dtypes and shapes in that order.
    The result is shared between callers: do not modify it."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, starts = 0, {}
    for name, dtype, shape in specs:
        n_bytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n_bytes],
        }
        starts[name] = offset
        offset += n_bytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    raw = len(raw).to_bytes(8, "little") + raw
    return raw, {name: len(raw) + start for name, start in starts.items()}, len(raw) + offset


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
        flat = flat.view(torch.int16)
    return memoryview(flat.numpy()).cast("B")


def safetensors_crc32(items: list[tuple[str, torch.Tensor]]) -> int:
    """The CRC-32 of the safetensors file these tensors make in this order (what a handoff
    manifest records for model.safetensors), computed without writing the file: equal
    CRCs say two holders have the same tensors bit for bit."""
    header, _, _ = layout(tuple((name, t.dtype, tuple(t.shape)) for name, t in items))
    crc = crc32(header)
    for _, tensor in items:
        crc = crc32(tensor_bytes(tensor.detach().cpu()), crc)
    return crc


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
        self._file = open(directory / name, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._writeback = Writeback(self._file.fileno())
        self._write(layout(tuple(specs))[0])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:  # unbuffered: a write may take less than asked
            view = view[self._file.write(view) :]
        self._crc = crc32(data, self._crc)
        self._writeback.wrote(self._size, len(data))
        self._size += len(data)

    def _run(self) -> None:
        while (tensor := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write(tensor_bytes(tensor))
                except BaseException as exc:  # reported by close()
                    self._error = exc

    def put(self, tensor: torch.Tensor) -> None:
        """Queue the next tensor (blocks when `depth` tensors are already waiting)."""
        self._queue.put(tensor.detach().cpu())

    def close(self) -> FileRecord:
        """Finish writing, fsync, and return the file's record; re-raises writer errors."""
        self._queue.put(None)
        self._thread.join()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._error is not None:
            raise self._error
        return FileRecord(self.name, self._size, self._crc)


class PieceWriter:
    """Write byte ranges of one preallocated file, from several processes at once.

    Usage: one process calls `PieceWriter.create(path, header, size)`; then every writer
    opens `PieceWriter(path)`, calls `write(offset, tensor)` for its ranges (`os.pwrite`,
    so writers never share a file position) and `close()`, which fsyncs and returns the
    pieces with their CRC-32s for `handoff.combine_pieces`. No bytes cross between
    processes: this is how FSDP ranks write their shards of one safetensors file.
    """

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_WRONLY)
        self._writeback = Writeback(self._fd)
        self.pieces: list[Piece] = []

    @staticmethod
    def create(path: Path, header: bytes, size: int) -> Piece:
        """Create the file at its final size (sparse) with `header` at offset 0."""
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(size)
        return Piece(0, len(header), crc32(header))

    def write(self, offset: int, tensor: torch.Tensor | memoryview) -> None:
        """Write a tensor's bytes (or bytes already taken with `tensor_bytes`) at `offset`."""
        data = tensor if isinstance(tensor, memoryview) else tensor_bytes(tensor.cpu())
        done = 0
        while done < len(data):  # pwrite may write less than asked
            done += os.pwrite(self._fd, data[done:], offset + done)
        self._writeback.wrote(offset, len(data))
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.offset + last.size == offset:  # extends the last piece
            self.pieces[-1] = Piece(last.offset, last.size + len(data), crc32(data, last.crc32))
        else:  # (one rank's pieces stay few, so combining them costs next to nothing)
            self.pieces.append(Piece(offset, len(data), crc32(data)))

    def close(self) -> list[Piece]:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        return self.pieces


def read_tensors(
    path: Path, buffer: bytearray | None = None
) -> tuple[dict[str, torch.Tensor], bytearray]:
    """Read a safetensors file into `buffer` and return its tensors as views of it.

    One copy from the page cache into memory that is reused from one call to the next
    (pass back the returned buffer; it is replaced when the size differs), and no
    allocation per tensor: a server reloading weights every step skips most of the page
    faults and copies of a fresh read. The tensors alias the buffer, so read the next file
    into it only once they are no longer used. A truncated or malformed file raises
    ValueError saying what is wrong."""
    size = path.stat().st_size
    if buffer is None or len(buffer) != size:
        buffer = bytearray(size)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size and (n := f.readinto(view[done:])):
            done += n
    if done != size or size < 8:
        raise ValueError(f"{path.name} is truncated ({done} of {size} bytes read)")
    header_len = int.from_bytes(buffer[:8], "little")
    if header_len > size - 8:
        raise ValueError(f"{path.name}: header of {header_len} bytes does not fit in the file")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except ValueError as exc:
        raise ValueError(f"{path.name}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is not a JSON object")
    start, data_size = 8 + header_len, size - 8 - header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _BY_NAME[info["dtype"]], [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path.name}: bad header entry for tensor {name}") from None
        item = dtype.itemsize
        n_bytes = math.prod(shape) * item
        if not 0 <= begin <= end <= data_size or end - begin != n_bytes:
            raise ValueError(
                f"{path.name}: tensor {name} lies outside the file or has the wrong size"
            )
        offset = start + begin
        if offset % item:  # unaligned: copy it out
            raw: bytearray | memoryview = bytearray(view[offset : offset + n_bytes])
            offset = 0
        else:
            raw = buffer
        count = n_bytes // item
        flat = (
            torch.frombuffer(raw, dtype=dtype, count=count, offset=offset)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.view(shape)
    return tensors, buffer


def write_safetensors(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """Write a dict of tensors as one safetensors file (streaming, fsynced)."""
    writer = StreamingWriter(
        directory, name, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    )
    for value in tensors.values():
        writer.put(value)
    return writer.close()

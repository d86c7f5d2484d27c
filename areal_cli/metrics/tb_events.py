"""TensorBoard scalars (RUN/tensorboard/), written without TensorBoard's libraries.

A TensorBoard event file is a sequence of records, each
    uint64 length, uint32 masked CRC-32C of the length, the data, uint32 masked CRC-32C
    of the data (little-endian),
whose data is a serialized `tensorflow.Event` protocol buffer. The controller writes only
scalars, which take three small messages, encoded here by hand:
    Event   {1: wall_time (double), 2: step (int64), 3: file_version (string),
             5: summary (Summary)}
    Summary {1: value (Value, repeated)}
    Value   {1: tag (string), 2: simple_value (float)}
The first record of a file carries `file_version: "brain.Event:2"`, as TensorBoard's own
writers put it. Why not tensorboardX: it imports torch, two seconds of CPU in the
controller while the servers and the trainer start on the same cores, and the GPU
machines we are lent do not have it.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int64 is ten bytes of two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int | None = None, rest: bytes = b"") -> bytes:
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _varint(2 << 3 | 0) + _varint(step)
    return out + rest


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """The serialized Event of one scalar."""
    summary_value = _field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)
    return _event(wall_time, step, _field(5, _field(1, summary_value)))


def record(data: bytes) -> bytes:
    """One TFRecord frame around `data`."""
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
    )


class ScalarWriter:
    """Appends scalars to one event file under `directory` (SummaryWriter's
    `add_scalar`/`flush`/`close`); each flush writes what was added since."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = directory / name
        self._file = open(self.path, "ab")  # noqa: SIM115 - lives as long as the run
        self._pending = [record(_event(now, rest=_field(3, b"brain.Event:2")))]
        self.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._pending.append(record(scalar_event(tag, float(value), int(step), time.time())))

    def flush(self) -> None:
        if self._pending:
            self._file.write(b"".join(self._pending))
            self._file.flush()
            self._pending = []

    def close(self) -> None:
        self.flush()
        self._file.close()

"""RUN/tensorboard's scalars, written by areal's own writer, read back by TensorBoard's
own protocol buffers (tensorboardX's copy of them) with every record's CRC checked."""

from __future__ import annotations

import struct
from pathlib import Path

from areal_cli.metrics.tb_events import ScalarWriter, crc32c, masked_crc


def _records(path: Path) -> list[bytes]:
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (length_crc,) = struct.unpack_from("<I", data, at + 8)
        assert length_crc == masked_crc(data[at : at + 8])
        body = data[at + 12 : at + 12 + length]
        (body_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        assert body_crc == masked_crc(body)
        out.append(body)
        at += 12 + length + 4
    return out


def test_crc32c_matches_the_standard_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value


def test_scalars_read_back_as_tensorboard_events(tmp_path: Path) -> None:
    from tensorboardX.proto.event_pb2 import Event

    writer = ScalarWriter(tmp_path / "tb")
    writer.add_scalar("reward_mean", 0.3125, 1)
    writer.add_scalar("loss", -0.0737, 1)
    writer.flush()
    writer.add_scalar("reward_mean", 0.984, 24)
    writer.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = [Event.FromString(r) for r in _records(path)]
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 0
    got = [(e.step, v.tag, round(v.simple_value, 4)) for e in events[1:] for v in e.summary.value]
    assert got == [(1, "reward_mean", 0.3125), (1, "loss", -0.0737), (24, "reward_mean", 0.984)]

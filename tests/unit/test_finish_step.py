"""A step's metrics line is on record before its recover entry exists (a kill between the
two must lose the entry, which the resume redoes, never the line)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from areal_cli.trainer import main as trainer_main


class Killed(Exception):
    pass


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_the_line_is_written_before_the_recover_entry(tmp_path, one_rank, monkeypatch) -> None:
    def save_recover(*args, **kwargs):
        line = (tmp_path / "logs" / "trainer-metrics.jsonl").read_text()
        assert json.loads(line)["step"] == 1
        raise Killed  # the process dies while it writes the entry

    monkeypatch.setattr(trainer_main.checkpoint, "save_recover", save_recover)
    cfg = SimpleNamespace(
        recover=SimpleNamespace(freq_steps=2, keep_last=1), saver=SimpleNamespace(freq_steps=0)
    )
    scheduler = SimpleNamespace(state_dict=lambda: {})
    beat = SimpleNamespace(phase=lambda _: None, steps_done=1)
    with pytest.raises(Killed):
        trainer_main.finish_step(1, cfg, tmp_path, None, None, scheduler, None, {"step": 1}, beat)
    assert beat.steps_done == 1  # not counted as done

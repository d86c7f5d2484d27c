"""The trainer's per-step record round-trips through its one-line JSON form."""

import json

from areal_cli.rundir.records import RL_FIGURES, TrainerStep


def test_a_record_round_trips_and_stays_flat():
    record = TrainerStep(
        step=3,
        train_s=1.5,
        figures={"loss": -0.25, "grad_norm": 0.5, "custom": 7.0},
        weight_version=3,
        wait_s=0.1,
        publish_s=0.2,
        peak_rss_mb=900.0,
        state_mb=12.0,
    )
    line = record.to_json()
    flat = json.loads(line)
    assert flat["step"] == 3 and flat["loss"] == -0.25 and flat["weight_version"] == 3
    assert TrainerStep.from_json(line) == record
    assert record.pick(RL_FIGURES) == {"loss": -0.25, "grad_norm": 0.5}
    assert record.pick(("state_mb", "missing")) == {"state_mb": 12.0}


def test_a_supervised_record_has_no_weight_version():
    record = TrainerStep(step=1, train_s=0.5, figures={"loss": 2.0})
    assert "weight_version" not in json.loads(record.to_json())
    assert TrainerStep.from_json(record.to_json()).weight_version is None

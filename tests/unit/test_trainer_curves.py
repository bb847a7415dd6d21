"""Training curves land in TensorBoard event files, one point per step, readable back."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from tensorboardX.proto.event_pb2 import Event

from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.services.trainer.curves import CURVES, CurveWriter


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the directory's event files (TFRecord framing: length, its CRC, the
    record, its CRC), by tag, in step order."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            record = data[offset + 12:offset + 12 + length]
            offset += 12 + length + 4
            event = Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_each_step_is_one_point_on_every_curve(tmp_path):
    writer = CurveWriter(tensorboard_dir=str(tmp_path))
    assert writer.enabled
    for step, reward in [(1, 0.25), (2, 0.5)]:
        writer.step(tpb.StepSummary(step=step, mean_reward=reward, loss=-0.1 * step,
                                    tokens_per_second=100.0 * step),
                    {"reward/failures": float(step - 1)})
    writer.close()
    scalars = read_scalars(tmp_path)
    assert set(CURVES.values()) | {"reward/failures"} == set(scalars)
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["throughput/tokens_per_second"] == [(1, 100.0), (2, 200.0)]
    assert scalars["reward/failures"] == [(1, 0.0), (2, 1.0)]


def test_no_sink_configured_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    writer = CurveWriter()
    writer.step(tpb.StepSummary(step=1))
    writer.close()
    assert not writer.enabled


def test_a_wandb_project_without_wandb_installed_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ValueError, match="needs the wandb package"):
        CurveWriter(wandb_project="my-runs")

"""The demo's verdict: it fails unless reward visibly rose between the first and last steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from rlharvest.common.pb import trainer_pb2 as tpb
from rlharvest.cli import demo, report
from rlharvest.cli.report import reward_ends, rise_failure


def test_the_ends_average_up_to_three_steps_and_never_share_one() -> None:
    assert reward_ends([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) == pytest.approx((0.2, 0.6, 3))
    assert reward_ends([0.1, 0.5, 0.9]) == pytest.approx((0.1, 0.9, 1))
    with pytest.raises(ValueError, match="at least 2 steps"):
        reward_ends([0.4])


def test_a_run_whose_reward_rose_passes() -> None:
    assert rise_failure([0.02, 0.05, 0.03, 0.2, 0.3, 0.45, 0.5], min_rise=0.1) is None


@pytest.mark.parametrize("rewards", [
    [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],  # flat
    [0.5, 0.4, 0.45, 0.2, 0.1, 0.15],  # fell
    [0.1, 0.12, 0.1, 0.15, 0.14, 0.16],  # rose, but by less than min_rise
])
def test_a_run_whose_reward_did_not_rise_fails_and_says_by_how_much(rewards) -> None:
    failure = rise_failure(rewards, min_rise=0.1)
    assert failure is not None and failure.startswith("reward did not rise")
    assert "last 3 steps" in failure and "needed +0.1" in failure


def test_too_short_a_run_cannot_show_a_rise() -> None:
    assert "too few" in rise_failure([0.9], min_rise=0.0)
    assert rise_failure([], min_rise=0.0) is not None


def _finished_run(monkeypatch, rewards: list[float]) -> None:
    """Stand in for the stack and the training it drives: the run ends with these rewards."""
    stack = SimpleNamespace(stop=lambda: None)
    monkeypatch.setattr(demo, "_start_stack", lambda log_dir, args: SimpleNamespace(
        stack=stack, events={}, serving=None, killed_manager=None))

    async def drive(run, schedule, steps, timeout) -> tpb.TrainerStatus:
        return tpb.TrainerStatus(state="done", steps=[
            tpb.StepSummary(step=i + 1, weight_version=i, mean_reward=r, tokens_per_second=100)
            for i, r in enumerate(rewards)])

    monkeypatch.setattr(demo, "drive", drive)


@pytest.mark.parametrize("rewards, exit_code", [
    ([0.05, 0.05, 0.05, 0.3, 0.4, 0.5], 0),
    ([0.3, 0.3, 0.3, 0.3, 0.3, 0.3], 1),
])
def test_the_demo_exits_non_zero_with_the_reason_when_reward_did_not_rise(
        monkeypatch, tmp_path, rewards, exit_code) -> None:
    _finished_run(monkeypatch, rewards)
    result = CliRunner().invoke(demo.app, ["--steps", "6", "--out", str(tmp_path),
                                           "--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == exit_code, result.output
    assert ("reward did not rise" in result.output) == bool(exit_code)
    assert (tmp_path / "demo.png").is_file()  # the report is written either way


def test_the_demo_gives_up_after_the_specs_five_minutes_by_default() -> None:
    timeout = next(p for p in typer.main.get_command(demo.app).params if p.name == "timeout")
    assert timeout.default == 300


def test_the_step_table_shows_tail_batching_rounds_only_when_they_ran() -> None:
    plain = tpb.TrainerStatus(steps=[tpb.StepSummary(step=1)])
    tail = tpb.TrainerStatus(steps=[
        tpb.StepSummary(step=1, round="short", prompts_launched=10, prompts_deferred=2,
                        tokens_discarded=77),
        tpb.StepSummary(step=2, round="long", prompts_launched=8)])
    assert "round" not in [c.header for c in report.step_table(plain, {}).columns]
    table = report.step_table(tail, {})
    cells = {c.header: list(c.cells) for c in table.columns}
    assert cells["round"] == ["short 10", "long 8"]
    assert cells["deferred"] == ["2", "0"] and cells["discarded"] == ["77", "0"]


def test_the_step_table_shows_each_published_versions_changed_share() -> None:
    status = tpb.TrainerStatus(steps=[
        tpb.StepSummary(step=1, published_version=2, published_changed=1.0),
        tpb.StepSummary(step=2, published_version=3, published_changed=0.0123),
        tpb.StepSummary(step=3)])  # published nothing
    cells = {c.header: list(c.cells) for c in report.step_table(status, {}).columns}
    assert cells["Δ changed"] == ["100.0%", "1.2%", "-"]


def test_an_eta_below_one_is_refused(tmp_path) -> None:
    result = CliRunner().invoke(demo.app, ["--tail-batching", "0.5", "--log-dir", str(tmp_path)])
    assert result.exit_code == 2 and "give 1 or more" in result.output


def test_the_placed_demos_table_has_a_row_per_step_and_two_columns_per_job() -> None:
    from rich.console import Console

    from rlharvest.common.pb import trainer_pb2 as tpb
    from rlharvest.cli.demo_placed import jobs_table

    statuses = {job: tpb.TrainerStatus(steps=[tpb.StepSummary(step=i + 1, mean_reward=0.1 * i,
                                                              step_time_s=0.5)
                                              for i in range(n)])
                for job, n in (("job-a", 3), ("job-b", 2))}
    table = jobs_table(statuses)
    assert [c.header for c in table.columns] == [
        "step", "job-a reward", "job-a step s", "job-b reward", "job-b step s"]
    assert table.row_count == 3
    console = Console(width=120, record=True)
    console.print(table)
    assert "0.200" in console.export_text()  # job-a's third step; job-b has none there


def test_without_matplotlib_the_report_writes_the_steps_and_says_there_is_no_plot(
        monkeypatch, tmp_path) -> None:
    """matplotlib is in the dev extra only: `rlharvest train` on a plain install must finish
    with its steps.json, not die at the plot after training."""
    real = report.importlib.util.find_spec
    monkeypatch.setattr(report.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    status = tpb.TrainerStatus(state="done", steps=[tpb.StepSummary(step=1, mean_reward=0.5)])
    said = report.write_report(status, {}, tmp_path, "train.png")
    assert "no plot: matplotlib is not installed" in said
    assert (tmp_path / "steps.json").is_file() and not (tmp_path / "train.png").exists()
    monkeypatch.undo()
    assert report.write_report(status, {}, tmp_path, "train.png").startswith("plot ")  # with it
    assert (tmp_path / "train.png").is_file()

"""Spot availability traces (RLBoost App. C, Table 5) and the replayer that runs at most N_prem
of the available instances, killing a preempted one and starting another at once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlharvest.sim.spot_trace import (
    SEGMENTS,
    Kill,
    SpotTrace,
    Start,
    Stop,
    TraceEvent,
    TraceReplayer,
    synthesize,
)


def trace(*events: tuple[float, str, str], duration: float = 10.0) -> SpotTrace:
    return SpotTrace([TraceEvent(t, kind, i) for t, kind, i in events], duration)  # type: ignore[arg-type]


@pytest.mark.parametrize("segment", sorted(SEGMENTS))
def test_a_synthesized_segment_has_table_5s_allocations_preemptions_and_mean(segment):
    spec = SEGMENTS[segment]
    got = synthesize(segment, seed=3)
    assert (got.allocations, got.preemptions) == (spec.allocations, spec.preemptions)
    assert got.mean_count() == pytest.approx(spec.mean_instances, abs=0.75)
    assert synthesize(segment, seed=3).events == got.events  # a seed replays the same trace


def test_counts_and_the_time_weighted_mean_of_a_worked_trace():
    t = trace((0, "add", "a"), (0, "add", "b"), (4, "remove", "a"), (6, "add", "c"))
    assert [t.count_at(x) for x in (0, 3.9, 4, 5, 6, 9)] == [2, 2, 1, 1, 2, 2]
    assert t.available_at(7) == ["b", "c"]
    assert t.mean_count() == pytest.approx((2 * 4 + 1 * 2 + 2 * 4) / 10)
    assert (t.allocations, t.preemptions) == (1, 1)
    assert t.per_step(5) == [2, 2, 1, 2, 2]
    assert t.scaled(1.0).count_at(0.45) == 1


@pytest.mark.parametrize("events, message", [
    ([(1, "remove", "a")], "added and not removed"),
    ([(0, "add", "a"), (1, "add", "a")], "must be new"),
    ([(11, "add", "a")], "outside"),
])
def test_an_inconsistent_trace_is_refused_naming_the_event(events, message):
    with pytest.raises(ValueError, match=message):
        trace(*events)


def test_a_trace_file_round_trips_and_a_bad_row_is_refused_by_line(tmp_path):
    original = synthesize("C", duration=600, seed=1)
    path = tmp_path / "trace.csv"
    original.to_csv(path)
    again = SpotTrace.from_csv(path, duration=600)
    assert [e.instance for e in again.events] == [e.instance for e in original.events]
    assert again.mean_count() == pytest.approx(original.mean_count(), abs=1e-2)
    path.write_text("time_s,event,instance\n0,add,a\nsoon,add,b\n")
    with pytest.raises(ValueError, match="trace.csv:3"):
        SpotTrace.from_csv(path)


def test_the_replayer_caps_kills_the_preempted_and_starts_a_standby_at_once():
    t = trace((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (5, "remove", "a"))
    replay = TraceReplayer(t)
    assert replay.advance(0, n_prem=2) == [Start("a"), Start("b")]
    assert replay.advance(1, n_prem=2) == []
    assert replay.advance(5, n_prem=2) == [Kill("a"), Start("c")]  # at once, from the pool
    assert replay.advance(6, n_prem=1) == [Stop("c")]  # the latest started leaves first
    assert replay.advance(7, n_prem=None) == [Start("c")]
    with pytest.raises(ValueError, match=">= 0"):
        replay.advance(8, n_prem=-1)


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 8)), min_size=1, max_size=40),
       st.integers(0, 5))
def test_the_replayer_never_exceeds_the_cap_nor_runs_an_unavailable_instance(moves, seed):
    t = synthesize("A", duration=100, seed=seed)
    replay = TraceReplayer(t)
    running: set[str] = set()
    for at, cap in sorted(moves):
        for action in replay.advance(at, cap):
            if isinstance(action, Start):
                assert action.instance not in running
                running.add(action.instance)
            else:
                running.remove(action.instance)
        assert running == set(replay.running)
        assert len(running) == min(cap, t.count_at(at))
        assert running <= set(t.available_at(at))

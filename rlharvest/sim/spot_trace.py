"""Spot-instance availability traces and their replayer (RLBoost §6 "Traces", App. C, Table 5).

A trace is the allocation ("add") and preemption ("remove") events of spot instances over time,
as the paper replays from a real cloud trace. The paper's three 2-hour segments are not public;
``synthesize`` builds a trace with a segment's published characteristics (Table 5: mean
instances, allocations, preemptions) from a seed, and a file in the same form
(``time_s,event,instance`` CSV) replays a real one.

``TraceReplayer`` is the paper's replayer, pure: at any time it runs at most N_prem of the
instances the trace makes available ("we control the maximum number of running preemptible
instances, N_prem, according to Algorithm 1, instead of allocating all available instances");
an instance the trace removes is killed and an available one started at once ("the trace
replayer will shut down the instance and immediately start a new one if available"). When the
cap falls, the latest started instances are stopped gracefully (their requests migrate); a
preempted one is killed (SIGKILL, as the cloud does).
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EventKind = Literal["add", "remove"]


@dataclass(frozen=True)
class TraceEvent:
    t: float  # seconds from the trace's start
    kind: EventKind
    instance: str


@dataclass(frozen=True)
class Segment:
    mean_instances: float
    allocations: int
    preemptions: int


# RLBoost Table 5 (2-hour segments of 2xH100 spot instances).
SEGMENTS = {"A": Segment(6.53, 13, 8), "B": Segment(4.58, 8, 9), "C": Segment(6.06, 6, 2)}


class SpotTrace:
    """Events sorted by time; an instance is added once, then removed at most once. Instances
    added at t = 0 are the starting pool, not allocations."""

    def __init__(self, events: Sequence[TraceEvent], duration: float) -> None:
        if duration <= 0:
            raise ValueError(f"a trace lasts > 0 seconds, got {duration}")
        self.events = tuple(sorted(events, key=lambda e: e.t))
        self.duration = duration
        state: dict[str, EventKind] = {}
        for e in self.events:
            if not 0 <= e.t <= duration:
                raise ValueError(f"event {e} lies outside the trace's [0, {duration}] s")
            if e.kind not in ("add", "remove"):
                raise ValueError(f"event {e}: kind must be 'add' or 'remove'")
            expected = None if e.kind == "add" else "add"
            if state.get(e.instance) != expected:
                raise ValueError(f"event {e}: instance {e.instance!r} must be "
                                 + ("new" if e.kind == "add" else "added and not removed yet"))
            state[e.instance] = e.kind

    def available_at(self, t: float) -> list[str]:
        """Instances present at ``t``, in the order they were added."""
        present: dict[str, None] = {}
        for e in self.events:
            if e.t > t:
                break
            if e.kind == "add":
                present[e.instance] = None
            else:
                present.pop(e.instance, None)
        return list(present)

    def count_at(self, t: float) -> int:
        return len(self.available_at(t))

    def per_step(self, steps: int) -> list[int]:
        """Availability sampled at ``steps`` evenly spaced times: a step-indexed trace for the
        simulator, the same for every variant compared on it."""
        return [self.count_at(self.duration * k / steps) for k in range(steps)]

    def mean_count(self) -> float:
        """Time-weighted mean of available instances over the trace."""
        area, count, last = 0.0, 0, 0.0
        for e in self.events:
            area += count * (e.t - last)
            count += 1 if e.kind == "add" else -1
            last = e.t
        return (area + count * (self.duration - last)) / self.duration

    @property
    def allocations(self) -> int:
        return sum(1 for e in self.events if e.kind == "add" and e.t > 0)

    @property
    def preemptions(self) -> int:
        return sum(1 for e in self.events if e.kind == "remove")

    def scaled(self, seconds: float) -> SpotTrace:
        """The same trace compressed (or stretched) to last ``seconds``: a 2-hour segment
        replayed on a local stack in minutes."""
        f = seconds / self.duration
        return SpotTrace([TraceEvent(e.t * f, e.kind, e.instance) for e in self.events], seconds)

    @classmethod
    def from_csv(cls, path: str | Path, duration: float | None = None) -> SpotTrace:
        """``time_s,event,instance`` rows (a header row is allowed); the duration defaults to
        the last event's time."""
        events = []
        with open(path, newline="") as f:
            for line, row in enumerate(csv.reader(f), 1):
                if not row or row[0].strip().startswith("#") or row[0].strip() == "time_s":
                    continue
                try:
                    t, kind, instance = float(row[0]), row[1].strip(), row[2].strip()
                except (IndexError, ValueError):
                    raise ValueError(f"{path}:{line}: expected time_s,event,instance, got "
                                     f"{','.join(row)!r}") from None
                events.append(TraceEvent(t, kind, instance))  # type: ignore[arg-type]
        if not events:
            raise ValueError(f"{path}: no events")
        return cls(events, duration or max(e.t for e in events) or 1.0)

    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["time_s", "event", "instance"])
            for e in self.events:
                writer.writerow([f"{e.t:.3f}", e.kind, e.instance])


def synthesize(segment: str, duration: float = 7200.0, seed: int = 0) -> SpotTrace:
    """A trace with Table 5's characteristics for ``segment`` (A, B or C): exactly its
    allocations and preemptions at random times, and the starting pool whose time-weighted
    mean comes closest to its mean instance count."""
    if segment not in SEGMENTS:
        raise ValueError(f"unknown segment {segment!r}; RLBoost Table 5 has {sorted(SEGMENTS)}")
    spec = SEGMENTS[segment]
    rng = random.Random(f"{segment}-{seed}")
    kinds = ["add"] * spec.allocations + ["remove"] * spec.preemptions
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.0, duration) for _ in kinds)
    best: SpotTrace | None = None
    for start in range(spec.preemptions + int(spec.mean_instances) + 2):
        trace = _build(start, kinds, times, duration, rng.random())
        if trace is not None and (best is None or abs(trace.mean_count() - spec.mean_instances)
                                  < abs(best.mean_count() - spec.mean_instances)):
            best = trace
    assert best is not None  # a large enough pool never runs out
    return best


def _build(start: int, kinds: list[str], times: list[float], duration: float,
           pick: float) -> SpotTrace | None:
    """The trace with ``start`` instances at t = 0; None when a preemption finds none left.
    ``pick`` chooses which present instance each preemption takes (the same for every start)."""
    events = [TraceEvent(0.0, "add", f"spot-{i}") for i in range(start)]
    present = [f"spot-{i}" for i in range(start)]
    chooser = random.Random(pick)
    for n, (kind, t) in enumerate(zip(kinds, times, strict=True)):
        if kind == "add":
            present.append(f"spot-{start + n}")
            events.append(TraceEvent(t, "add", present[-1]))
        elif not present:
            return None
        else:
            events.append(TraceEvent(t, "remove", present.pop(chooser.randrange(len(present)))))
    return SpotTrace(events, duration)


@dataclass(frozen=True)
class Start:
    instance: str


@dataclass(frozen=True)
class Stop:
    instance: str  # over the cap: stopped gracefully, its requests migrate


@dataclass(frozen=True)
class Kill:
    instance: str  # preempted by the trace: SIGKILL


Action = Start | Stop | Kill


class TraceReplayer:
    """Which spot instances run as the trace plays, under the cap N_prem (None: no cap)."""

    def __init__(self, trace: SpotTrace) -> None:
        self.trace = trace
        self.running: list[str] = []  # in start order

    def advance(self, t: float, n_prem: int | None) -> list[Action]:
        if n_prem is not None and n_prem < 0:
            raise ValueError(f"N_prem must be >= 0 (or None for no cap), got {n_prem}")
        available = self.trace.available_at(t)
        out: list[Action] = [Kill(i) for i in self.running if i not in available]
        self.running = [i for i in self.running if i in available]
        cap = len(available) if n_prem is None else n_prem
        while len(self.running) > cap:
            out.append(Stop(self.running.pop()))  # the latest started leaves first
        idle = [i for i in available if i not in self.running]
        while len(self.running) < cap and idle:
            self.running.append(idle.pop(0))
            out.append(Start(self.running[-1]))
        return out

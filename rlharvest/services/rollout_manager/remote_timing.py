"""How a step went on the remote (spot) instances: the manager's half of RLBoost Algorithm 1's
inputs (§4.1; the trainer measures t_train and t_train_wait, ``rlharvest/services/trainer/
seeding_window.py`` decides).

Per step, from the manager's clock:

- ``t_remote``: the mean, over the remote instances that produced tokens of the step, of the
  time from an instance's first to its last accepted tokens of the step: how long the step's
  rollout kept an instance busy. (The paper calls it the remote rollout time and says no more;
  first-to-last is what an instance spends on the step whatever the seeding window was.)
- ``t_remote_wait``: the mean over the same instances of the time from an instance's last
  tokens of the step to the step's end (its last completion delivered): the instance idles
  while the tail finishes elsewhere. Line 9 weighs it against the trainer's wait.
- ``n_prem_mean``: the time-weighted mean count of active remote instances (healthy spot
  workers not held as standby) over the step, from its start to its end.
- ``n_prem_next``: that count when the step ended: what the next step starts with.
- ``n_available_next``: healthy spot workers when the step ended, standby included: what the
  next step *could* use. Algorithm 1 clamps N_prem to availability; the active count alone
  would be the current cap, and N_prem could then never grow past it.

An agentic step is many Generate calls, each a step of its own here; the trainer opens a
*scope* for the whole of it (``scope_opened``, from ``HoldSeedWindow``), which takes the remote
tokens of every step while it is open and closes to the same timings over its lifetime.

Pure and synchronous (an injected clock); the control loop reports what happens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RemoteStepTimings:
    t_remote: float
    t_remote_wait: float
    n_prem_mean: float
    n_prem_next: int
    instances: int  # remote instances that produced tokens of the step
    n_available_next: int = 0


@dataclass
class _Open:
    started_at: float
    count_since: float  # when the active count last changed (or the step started)
    area: float = 0.0  # integral of the active count over [started_at, count_since]
    first: dict[str, float] = field(default_factory=dict)  # instance -> first tokens at
    last: dict[str, float] = field(default_factory=dict)


class RemoteTiming:
    """The remote timings of every step in flight, keyed by the step's key."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._count = 0
        self._available = 0
        self._open: dict[int, _Open] = {}
        self._scopes: dict[Hashable, _Open] = {}  # agentic steps: every step's tokens count

    @property
    def active(self) -> int:
        return self._count

    def step_opened(self, key: int) -> None:
        self._open[key] = self._opened()

    def scope_opened(self, key: Hashable) -> None:
        """An agentic step began: until ``scope_closed``, every remote token counts for it."""
        self._scopes[key] = self._opened()

    def _opened(self) -> _Open:
        now = self._clock()
        return _Open(started_at=now, count_since=now)

    def active_changed(self, count: int, available: int | None = None) -> None:
        """``count`` remote instances are active now, of ``available`` (default: ``count``)."""
        available = count if available is None else available
        if count < 0 or available < count:
            raise ValueError(f"instance counts must be 0 <= active <= available, got {count} "
                             f"of {available}")
        self._available = available
        if count == self._count:
            return
        now = self._clock()
        for step in (*self._open.values(), *self._scopes.values()):
            step.area += self._count * (now - step.count_since)
            step.count_since = now
        self._count = count

    def produced(self, keys: Iterable[int], instance: str) -> None:
        """A remote instance's tokens of steps ``keys`` (one worker event's) were accepted
        now. Open scopes count them once per event, however many of its steps are open."""
        steps = [step for key in keys if (step := self._open.get(key)) is not None]
        if not steps:
            return
        now = self._clock()
        for step in (*steps, *self._scopes.values()):  # scopes: usually none open
            step.first.setdefault(instance, now)
            step.last[instance] = now

    def step_closed(self, key: int) -> RemoteStepTimings | None:
        """The step ended; its timings (None for a step never opened or already closed)."""
        return self._timings(self._open.pop(key, None))

    def scope_closed(self, key: Hashable) -> RemoteStepTimings | None:
        """The agentic step's turns played; its timings (None: never opened, or closed)."""
        return self._timings(self._scopes.pop(key, None))

    def _timings(self, step: _Open | None) -> RemoteStepTimings | None:
        if step is None:
            return None
        now = self._clock()
        duration = now - step.started_at
        area = step.area + self._count * (now - step.count_since)
        instances = list(step.last)
        n = len(instances)
        return RemoteStepTimings(
            t_remote=sum(step.last[i] - step.first[i] for i in instances) / n if n else 0.0,
            t_remote_wait=sum(now - step.last[i] for i in instances) / n if n else 0.0,
            n_prem_mean=area / duration if duration > 0 else float(self._count),
            n_prem_next=self._count, instances=n, n_available_next=self._available)

"""A bounded asyncio pool that scores completions next to rollout (RollPacker §4.3,
"Asynchronous Reward Computation").

Completions are scored as they finish, at most ``max_concurrency`` at a time. A reward function
that raises, returns a non-number, or overruns ``timeout_s`` yields a recorded failure for that
sample (reward ``failure_reward``), never a stuck or crashed step.

Sync functions run on a fresh daemon thread per call rather than a fixed executor: a Python
thread cannot be killed, so a hung call in a fixed-size executor would hold a worker forever and,
once all workers hung, stall every later sample. Here a hung call is abandoned (its concurrency
slot is released at the timeout and the count shows in ``abandoned_calls``). Work that can hang
for real — running candidate code — belongs in ``sandbox``, whose subprocesses are killed. A sync
function made of several slow parts (the code reward's test cases) asks ``caller_gave_up()``
between them: once the pool stopped waiting, its result reaches no one, and more parts would only
run outside ``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Union, cast

from rlharvest.common.daemon_thread import run_in_daemon_thread
from rlharvest.common.plugin import load_object

# (prompt, completion, reference) -> reward; may be sync or async.
RewardFn = Callable[[str, str, str], Union[float, Awaitable[float]]]


# The sync call running on this thread (each call has its own): when the pool stops waiting.
_this_call = threading.local()


@dataclass(frozen=True)
class _Waiting:
    deadline: float  # time.monotonic(): the pool's timeout for this call
    stopped: threading.Event  # set once the pool no longer waits (timed out, cancelled, done)


def caller_gave_up() -> bool:
    """Whether the pool has stopped waiting for the sync reward call running on this thread:
    its timeout passed or its step was cancelled. False outside a pool's call (a direct call,
    a thread the function started itself)."""
    waiting: _Waiting | None = getattr(_this_call, "waiting", None)
    return waiting is not None and (waiting.stopped.is_set()
                                    or time.monotonic() >= waiting.deadline)


class RewardFailure(Exception):
    """Raised by a reward function to give its sample the failure reward with a reason (the
    candidate program crashed or timed out) when that is a verdict, not a bug in the function:
    the outcome's error is the reason alone, without an exception name."""


@dataclass(frozen=True)
class RewardRequest:
    sample_id: str
    prompt: str
    completion: str
    reference: str = ""
    # This sample's reward when it is not the pool's own: a dataset mixing sources picks one per
    # row from its data_source (rewards/builtin.py).
    reward_fn: RewardFn | None = None
    timeout_s: float | None = None  # this sample's kind's timeout; None: the pool's


@dataclass(frozen=True)
class RewardOutcome:
    sample_id: str
    reward: float
    ok: bool
    error: str  # "" when ok; otherwise what went wrong, for logs and metrics
    elapsed_s: float


def load_reward_fn(spec: str) -> RewardFn:
    """Import a reward function from ``"package.module:function"``."""
    fn = load_object(spec, "reward function", "function")
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable; a reward function is needed")
    return fn


class RewardPool:
    def __init__(self, reward_fn: RewardFn, *, max_concurrency: int, timeout_s: float,
                 failure_reward: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_concurrency <= 0 or timeout_s <= 0:
            raise ValueError(f"max_concurrency and timeout_s must be > 0, got {max_concurrency}, "
                             f"{timeout_s}")
        self._fn = reward_fn
        self._slots = asyncio.Semaphore(max_concurrency)
        self._timeout_s = timeout_s
        self._failure_reward = failure_reward
        self._clock = clock
        self.abandoned_calls = 0  # sync calls still running past their timeout

    async def score(self, request: RewardRequest) -> RewardOutcome:
        async with self._slots:
            start = self._clock()
            timeout = request.timeout_s or self._timeout_s
            stopped = threading.Event()
            try:
                reward = await asyncio.wait_for(self._call(request, timeout, stopped), timeout)
                if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
                        or not math.isfinite(reward):
                    raise TypeError(f"returned {reward!r}; a reward must be a finite number")
            except asyncio.TimeoutError:
                if not inspect.iscoroutinefunction(request.reward_fn or self._fn):
                    self.abandoned_calls += 1
                return self._failure(request, start, f"timed out after {timeout:g}s")
            except RewardFailure as exc:
                return self._failure(request, start, str(exc))
            except Exception as exc:  # noqa: BLE001 - any user-code failure is this sample's
                return self._failure(request, start, f"{type(exc).__name__}: {exc}")
            finally:
                stopped.set()  # an abandoned sync call sees it (caller_gave_up) and stops
            return RewardOutcome(request.sample_id, float(reward), True, "",
                                 self._clock() - start)

    async def score_all(self, requests: list[RewardRequest]) -> list[RewardOutcome]:
        return list(await asyncio.gather(*(self.score(r) for r in requests)))

    def _call(self, request: RewardRequest, timeout: float,
              stopped: threading.Event) -> Awaitable[Any]:
        fn = request.reward_fn or self._fn
        args = (request.prompt, request.completion, request.reference)
        if inspect.iscoroutinefunction(fn):
            # The check does not narrow the union of sync and async functions for the checker.
            return cast(Awaitable[Any], fn(*args))
        # Real time, not self._clock: the thread compares it with time.monotonic().
        waiting = _Waiting(time.monotonic() + timeout, stopped)

        def call() -> Any:
            _this_call.waiting = waiting  # this thread is new and runs this call alone
            return fn(*args)

        return run_in_daemon_thread(call, "reward-fn")

    def _failure(self, request: RewardRequest, start: float, error: str) -> RewardOutcome:
        return RewardOutcome(request.sample_id, self._failure_reward, False, error,
                             self._clock() - start)

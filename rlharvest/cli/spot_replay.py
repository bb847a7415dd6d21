"""`rlharvest up --spot-trace`: spot rollout workers started and SIGKILLed as a trace says.

The async shell of ``rlharvest/sim/spot_trace.py``'s replayer (RLBoost App. C): every tick it reads the
job's N_prem from etcd (written by the trainer's ``--instance-cap auto`` or by hand) and
carries out the replayer's decision on real worker processes: a preempted instance is
SIGKILLed (the manager migrates its requests with their tokens), an instance over the cap gets
SIGTERM (it drains), and an available one is started at once. The trace may be one of RLBoost
Table 5's segments, synthesized, or a CSV file, compressed to ``seconds`` of replay.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rlharvest.common import registry
from rlharvest.common.aio import wait_event
from rlharvest.cli.launcher import LocalStack, ServiceProcess
from rlharvest.sim.spot_trace import (
    SEGMENTS,
    Action,
    Kill,
    SpotTrace,
    Start,
    Stop,
    TraceReplayer,
    synthesize,
)

log = logging.getLogger(__name__)


def load_trace(spec: str, seconds: float, seed: int = 0) -> SpotTrace:
    """A Table 5 segment name (A, B, C) or a ``time_s,event,instance`` CSV file, compressed to
    last ``seconds``."""
    if spec in SEGMENTS:
        trace = synthesize(spec, seed=seed)
    elif Path(spec).is_file():
        trace = SpotTrace.from_csv(spec)
    else:
        raise ValueError(f"--spot-trace {spec!r} is neither a segment of RLBoost Table 5 "
                         f"({', '.join(sorted(SEGMENTS))}) nor a file")
    return trace.scaled(seconds)


class SpotReplay:
    def __init__(self, stack: LocalStack, trace: SpotTrace, worker_flags: list[str],
                 job: str = "default", report: Callable[[str], None] = log.info) -> None:
        self.stack = stack
        self.trace = trace
        self.replayer = TraceReplayer(trace)
        self.worker_flags = worker_flags
        self.job = job
        self.report = report
        self.processes: dict[str, ServiceProcess] = {}
        self.history: list[tuple[float, Action]] = []

    def apply(self, at: float, actions: list[Action]) -> None:
        for action in actions:
            self.history.append((at, action))
            proc = self.processes.get(action.instance)
            if isinstance(action, Start):
                if proc is not None and proc.alive():
                    # Still draining from an earlier stop: a worker id is unique while alive,
                    # so the old process goes now (its requests migrate with their tokens).
                    proc.kill()
                self.processes[action.instance] = self.stack.start(
                    "rollout_worker", action.instance,
                    ["--worker-id", action.instance, "--kind", "spot", *self.worker_flags])
            elif isinstance(action, Kill) and proc is not None:
                proc.kill()
            elif isinstance(action, Stop) and proc is not None and proc.alive():
                proc.process.send_signal(signal.SIGTERM)
            self.report(f"t={at:.1f}s: {type(action).__name__.lower()} {action.instance}")

    async def run(self, etcd, stopped: asyncio.Event, tick: float = 0.5) -> None:
        """Replay until ``stopped`` is set; the trace's last state holds after it ends."""
        started = time.monotonic()
        while not stopped.is_set():
            at = time.monotonic() - started
            cap = await registry.read_instance_cap(etcd, self.job)
            self.apply(at, self.replayer.advance(min(at, self.trace.duration), cap))
            await wait_event(stopped, tick)

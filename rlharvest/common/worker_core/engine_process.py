"""An engine in its own process: the worker's gRPC process keeps only a proxy.

In one process the engine's Python (scheduling, sampling, the step's bookkeeping) and the event
loop's gRPC send path take turns holding the GIL, and on a small machine the engine thread waits
for the loop to pick up its step. vLLM v1 splits the two: an engine core process steps the model,
its client process talks to the world. Here ``EngineProcess`` is that client: an ``Engine`` whose
every call is one message to a child process that owns the real engine, over a pipe.

* The child runs one step ahead of its caller: it computes step N+1 while the worker routes and
  sends step N (``step`` returns N+1 at once when it is done), and never more than one, so an
  abort lands at most one step late. The worker's calls between two of its steps (adds, aborts,
  a weight load and the aborts it brings) reach the child between two of its own steps, all of
  them between the same two: after a call the child holds until the next ``step``. A call made
  while the child steps waits for that step to end.
* Every message carries the engine's state after it (weight version, whether it has work, its
  load, its start weights' fingerprint): the pump reads those every step, and the newest
  message's state is never stale, so reading them costs no round trip. A step's own facts (its
  prefill tokens) come with its outputs. Steps computed ahead wait in order; ``has_work`` is
  true while one does.
* Semantics the worker keeps: a step computed before a call is handed out after it. Its
  outputs of a request the call aborted are dropped here, so a request added again under the
  same id (a migration sent straight back, a client's retry) never takes a token of the
  incarnation that ended; and a weight load ends every request the worker holds (the
  admission's ``on_weight_swap``, by aborts), so no token of the old weights is taken for the
  new version's.
* Tensors for ``load_weights`` cross through shared memory (``torch.multiprocessing``). A CPU
  tensor moves into shared memory the first time it is sent, so a held copy that the puller
  updates in place crosses again with no copy at all; but each one then holds two file
  descriptors for as long as it lives (torch's file_descriptor strategy): 800 for a model of
  400 tensors, near the usual soft limit of 1024. So the worker raises its soft limit toward
  the hard one first (``raise_fd_limit``), as vLLM does at start; the child inherits it.
* The child is spawned, not forked (the parent runs gRPC's threads). It exits when the pipe
  closes: its parent died (even by SIGKILL) or closed it. A child that dies makes the next call
  raise (the load, read at every idle heartbeat, checks that the child lives), which ends the
  pump, and the worker stops as for a broken engine.

``factory`` builds the engine in the child: a picklable callable (a top-level function or a
``functools.partial`` of one).
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rlharvest.common.engine_types import EngineLoad, EngineRequest, RequestOutput

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

    from rlharvest.common.worker_core.engine import Engine

log = logging.getLogger(__name__)
_CALLS = frozenset({"add", "abort", "load_weights"})
_REPLY, _STEP = 0, 1  # a call's answer; a step's outputs
_AHEAD = 1  # steps the child may run beyond those its caller took (2 measured no better)


class EngineProcessError(RuntimeError):
    """The engine's process died or broke the protocol."""


def _state(engine: Engine) -> tuple[int, bool, EngineLoad, str]:
    return engine.weight_version, engine.has_work(), engine.load(), engine.start_weights


def _serve(factory: Callable[[], Engine], conn: Connection) -> None:
    """The child: build the engine, then step one ahead of the parent and answer its calls
    between steps (see the module doc). Signals are the worker's to act on: it drains on
    SIGTERM while this engine runs on, and this exits when the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = factory()
    except BaseException as exc:  # tell the parent why, then go
        conn.send((_REPLY, False, EngineProcessError(f"the engine could not be built: {exc!r}"),
                   None))
        return
    conn.send((_REPLY, True, (engine.vocab_size, engine.batch_admission), _state(engine)))
    lead, hold = 0, True  # steps sent beyond those asked for; hold: a call came, await a step
    while True:
        if hold or lead >= _AHEAD or not engine.has_work() or conn.poll():
            try:
                op, args = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            if op == "close":
                return
            if op == "step":  # the parent took a step: one more may run ahead of it
                lead, hold = max(lead - 1, -1), False
            else:
                hold = True  # the calls of one mutation all land between the same two steps
                _answer(engine, conn, op, args)
        elif _step(engine, conn):
            lead += 1
        else:
            return  # a broken engine: the parent raises its error and stops the worker


def _answer(engine: Engine, conn: Connection, op: str, args: tuple) -> None:
    try:
        value = getattr(engine, op)(*args) if op in _CALLS else None
    except Exception as exc:  # the caller's to handle (EngineInputError, KeyError, ...)
        conn.send((_REPLY, False, exc, _state(engine)))
        return
    conn.send((_REPLY, True, value, _state(engine)))


def _step(engine: Engine, conn: Connection) -> bool:
    started = time.perf_counter()
    try:
        outputs = engine.step()
    except Exception as exc:
        conn.send((_STEP, False, exc, None))
        return False
    seconds = time.perf_counter() - started  # the step's own time (SelfTimed)
    conn.send((_STEP, True, (_columns(outputs), seconds, engine.last_step_prefill_tokens,
                             engine.weight_version), _state(engine)))
    return True


# A step's outputs cross as columns: pickling 32 RequestOutput objects took the child ~60 µs a
# step (their state dicts), the columns ~15 µs, and the child's step is the split's bottleneck.
Columns = tuple[tuple[str, ...], tuple[list[int], ...], tuple[list[float], ...],
                tuple[bool, ...], tuple[str, ...]]


def _columns(outputs: list[RequestOutput]) -> Columns:
    return (tuple(o.request_id for o in outputs), tuple(o.new_token_ids for o in outputs),
            tuple(o.new_logprobs for o in outputs), tuple(o.finished for o in outputs),
            tuple(o.finish_reason for o in outputs))


def _rows(columns: Columns) -> list[RequestOutput]:
    return [RequestOutput(*row) for row in zip(*columns)]


def _without(columns: Columns, request_id: str) -> Columns:
    """``columns`` less the rows of ``request_id``."""
    ids, tokens, logprobs, finished, reasons = columns
    if request_id not in ids:
        return columns
    keep = [i for i, other in enumerate(ids) if other != request_id]
    return (tuple(ids[i] for i in keep), tuple(tokens[i] for i in keep),
            tuple(logprobs[i] for i in keep), tuple(finished[i] for i in keep),
            tuple(reasons[i] for i in keep))


_FD_TARGET = 65536  # vLLM's target too


def raise_fd_limit(target: int = _FD_TARGET) -> None:
    """Raise this process's soft limit of open files toward ``target``, never past the hard
    limit (a warning when not allowed)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d (%s): a weight load of "
                    "more than %d tensors will fail", soft, want, exc, soft // 2)


class EngineProcess:
    """``Engine`` over a child process that owns the real one (see the module doc)."""

    def __init__(self, factory: Callable[[], Engine], *, start_timeout_s: float = 300.0) -> None:
        import torch.multiprocessing as mp  # its reducers move tensors through shared memory

        raise_fd_limit()  # before the spawn: the child inherits it
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(factory, child), name="engine-core",
                                 daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child: its death closes the pipe here
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise EngineProcessError(f"the engine process did not start in {start_timeout_s}s")
        self._steps: deque[tuple[Columns, float, int, int]] = deque()
        self._broken: EngineProcessError | None = None
        self._seconds, self._prefill_tokens, self._step_version = 0.0, 0, 0
        self._vocab_size, self._admission = self._read()[1]

    # ---- Engine --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def batch_admission(self) -> str:
        return self._admission

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def start_weights(self) -> str:
        return self._start_weights

    @property
    def last_step_prefill_tokens(self) -> int:
        return self._prefill_tokens

    @property
    def last_step_seconds(self) -> float:
        """The last step handed out, timed in the child (SelfTimed)."""
        return self._seconds

    @property
    def last_step_weight_version(self) -> int:
        """The version that computed the last step handed out: a step computed before a weight
        load is handed out after it (SelfTimed)."""
        return self._step_version

    def has_work(self) -> bool:
        return bool(self._steps) or self._work

    def load(self) -> EngineLoad:
        # The pump reads the load at every step and every idle heartbeat: an idle worker whose
        # engine process died learns it here, not at its next request.
        if not self._proc.is_alive():
            raise self._died(EOFError("no reply: the process exited"))
        return self._load

    def add(self, request: EngineRequest) -> None:
        self._call("add", request)

    def abort(self, request_id: str) -> RequestOutput:
        try:
            return self._call("abort", request_id)
        finally:
            # The steps waiting here were computed before the abort (the pipe is ordered, so
            # every one the child sent before its reply has been read): their outputs of this
            # request belong to the incarnation just ended. The hub routes by id only, so were
            # the id added again before they are handed out (a migration sent straight back, a
            # client retrying with the same ids) the new one would take them: a token twice.
            # Dropped even when the abort raised (the request ended in such a step).
            self._steps = deque((_without(columns, request_id), seconds, prefill, version)
                                for columns, seconds, prefill, version in self._steps)

    def step(self) -> list[RequestOutput]:
        """The next step's outputs: computed while the caller handled the last one, most often
        (the child runs one step ahead)."""
        self._send("step", ())
        while not self._steps:
            self._read()
        columns, self._seconds, self._prefill_tokens, self._step_version = self._steps.popleft()
        return _rows(columns)

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self._call("load_weights", dict(tensors), version)

    # ---- the process ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the child to exit, and make sure it does."""
        try:
            self._conn.send(("close", ()))
        except (OSError, ValueError):
            pass  # already gone
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout_s)
        self._conn.close()

    def _call(self, op: str, *args: Any) -> Any:
        self._send(op, args)
        while True:
            kind, value = self._read()
            if kind == _REPLY:
                return value

    def _send(self, op: str, args: tuple) -> None:
        try:
            self._conn.send((op, args))
        except (OSError, ValueError) as exc:
            raise self._died(exc) from exc

    def _read(self) -> tuple[int, Any]:
        """The next message. A step's outputs wait in order for ``step``; the state is always
        the newest one's (every message carries the engine's state after it)."""
        if self._broken is not None:
            raise self._broken
        try:
            kind, ok, value, state = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died(exc) from exc
        if state is not None:
            self._version, self._work, self._load, self._start_weights = state
        if ok and kind == _STEP:
            self._steps.append(value)
        elif not ok and kind == _STEP:  # the engine is broken: every call raises from now on,
            # not only the one that read it (whose own handler must not take it for its error)
            self._broken = EngineProcessError(f"the engine failed a step: {value!r}")
            raise self._broken from value
        elif not ok:
            raise value
        return kind, value

    def _died(self, exc: BaseException) -> EngineProcessError:
        self._proc.join(1.0)
        return EngineProcessError(f"the engine process is gone (exit code {self._proc.exitcode}):"
                                  f" {exc!r}")

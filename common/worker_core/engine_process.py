"""An engine in its own process: the worker's gRPC process keeps only a proxy (issue 16).

In one process the engine's Python (scheduling, sampling, the step's bookkeeping) and the event
loop's gRPC send path take turns holding the GIL, and on a small machine the engine thread waits
for the loop to pick up its step. vLLM v1 splits the two: an engine core process steps the model,
its client process talks to the world. Here ``EngineProcess`` is that client: an ``Engine`` whose
every call is one message to a child process that owns the real engine, over a pipe.

* The pump calls the engine only between steps, and one call at a time (engine.py), so the proxy
  is a strict request/reply: no call is in flight while another is sent.
* Every reply carries the engine's state after the call (weight version, whether it has work,
  its load, what the last step prefilled): the pump reads those once or twice per step, and the
  state changes only through calls, so reading a copy costs no round trip and is never stale.
* Tensors for ``load_weights`` cross through shared memory (``torch.multiprocessing``).
* The child is spawned, not forked (the parent runs gRPC's threads). It exits when the pipe
  closes: its parent died (even by SIGKILL) or closed it. A child that dies makes the next call
  raise (the load, read at every idle heartbeat, checks that the child lives), which ends the
  pump, and the worker stops as for a broken engine.

``factory`` builds the engine in the child: a picklable callable (a top-level function or a
``functools.partial`` of one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rlharvest.common.engine_types import EngineLoad, EngineRequest, RequestOutput

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

    from rlharvest.common.worker_core.engine import Engine

log = logging.getLogger(__name__)

_CALLS = frozenset({"add", "abort", "step", "load_weights"})


class EngineProcessError(RuntimeError):
    """The engine's process died or broke the protocol."""


def _state(engine: Engine) -> tuple[int, bool, EngineLoad, int]:
    return (engine.weight_version, engine.has_work(), engine.load(),
            engine.last_step_prefill_tokens)


def _serve(factory: Callable[[], Engine], conn: Connection) -> None:
    """The child: build the engine, then answer calls until the pipe closes."""
    try:
        engine = factory()
    except BaseException as exc:  # tell the parent why, then go
        conn.send((False, EngineProcessError(f"the engine could not be built: {exc!r}"), None))
        return
    conn.send((True, (engine.vocab_size, engine.batch_admission), _state(engine)))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if op == "close":
            return
        try:
            value = getattr(engine, op)(*args) if op in _CALLS else None
        except Exception as exc:  # the caller's to handle (EngineInputError, KeyError, ...)
            conn.send((False, exc, _state(engine)))
            continue
        conn.send((True, value, _state(engine)))


class EngineProcess:
    """``Engine`` over a child process that owns the real one (see the module doc)."""

    def __init__(self, factory: Callable[[], Engine], *, start_timeout_s: float = 300.0) -> None:
        import torch.multiprocessing as mp  # its reducers move tensors through shared memory

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(factory, child), name="engine-core",
                                 daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child: its death closes the pipe here
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise EngineProcessError(f"the engine process did not start in {start_timeout_s}s")
        self._vocab_size, self._admission = self._reply()

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
    def last_step_prefill_tokens(self) -> int:
        return self._prefill_tokens

    def has_work(self) -> bool:
        return self._has_work

    def load(self) -> EngineLoad:
        # The pump reads the load at every step and every idle heartbeat: an idle worker whose
        # engine process died learns it here, not at its next request.
        if not self._proc.is_alive():
            raise self._died(EOFError("no reply: the process exited"))
        return self._load

    def add(self, request: EngineRequest) -> None:
        self._call("add", request)

    def abort(self, request_id: str) -> RequestOutput:
        return self._call("abort", request_id)

    def step(self) -> list[RequestOutput]:
        return self._call("step")

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
        try:
            self._conn.send((op, args))
        except (OSError, ValueError) as exc:
            raise self._died(exc) from exc
        return self._reply()

    def _reply(self) -> Any:
        try:
            ok, value, state = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died(exc) from exc
        if state is not None:
            self._version, self._has_work, self._load, self._prefill_tokens = state
        if not ok:
            raise value
        return value

    def _died(self, exc: BaseException) -> EngineProcessError:
        self._proc.join(1.0)
        return EngineProcessError(f"the engine process is gone (exit code {self._proc.exitcode}):"
                                  f" {exc!r}")

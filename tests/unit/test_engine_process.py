"""An engine in its own process (issue 16; vLLM v1's engine-core split) answers every call as
the engine itself would: the same tokens, the same refusals, weights loaded across the pipe; and
a child that dies makes the next call fail loudly instead of hanging."""

from __future__ import annotations

import os
import signal
from collections import defaultdict

import pytest
import torch

from rlharvest.common.engine_types import EngineInputError, EngineRequest, SamplingParams
from rlharvest.common.worker_core.engine_process import EngineProcess, EngineProcessError
from rlharvest.services.rollout_worker.torch_engine import TorchEngine


def tiny(seed: int = 0) -> TorchEngine:
    """Top-level, so the spawned child can import and call it."""
    torch.set_num_threads(1)
    return TorchEngine("tiny", seed=seed, max_running=4, max_len=128)


def broken() -> TorchEngine:
    raise RuntimeError("no such model")


def requests(n: int = 6) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=10 + i, seed=i))
            for i in range(n)]


def run(engine, batch: list[EngineRequest]) -> dict[str, list[int]]:
    for request in batch:
        engine.add(request)
    out: dict[str, list[int]] = defaultdict(list)
    while engine.has_work():
        for output in engine.step():
            out[output.request_id] += output.new_token_ids
    return dict(out)


@pytest.fixture
def proc():
    engine = EngineProcess(tiny)
    yield engine
    engine.close()


def test_an_engine_process_generates_the_tokens_the_engine_does_in_process(proc):
    local = tiny()
    assert run(proc, requests()) == run(local, requests())
    assert (proc.vocab_size, proc.batch_admission) == (local.vocab_size, local.batch_admission)
    assert proc.load() == local.load() and not proc.has_work()
    # Its state is read after every call: an add shows in the load at once.
    proc.add(requests(1)[0])
    assert proc.has_work() and proc.load().pending == 1
    assert proc.abort("r0").finish_reason == "abort"
    assert not proc.has_work()


def test_a_refusal_in_the_child_reaches_the_caller_as_the_engines_own_error(proc):
    with pytest.raises(EngineInputError, match="empty"):
        proc.add(EngineRequest("bad", [], SamplingParams()))
    with pytest.raises(KeyError):
        proc.abort("never-added")
    assert run(proc, requests(2)) == run(tiny(), requests(2))  # and it goes on serving


def test_weights_loaded_across_the_pipe_change_what_it_generates(proc):
    other = tiny(seed=1)
    proc.load_weights(other.weights(), 7)
    assert proc.weight_version == 7
    assert run(proc, requests()) == run(other, requests())
    assert run(proc, requests()) != run(tiny(), requests())


def test_a_child_that_dies_makes_the_next_call_fail_with_its_exit_code(proc):
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError, match="exit code -9"):
        proc.step()


def test_an_engine_that_cannot_be_built_fails_the_start_with_the_reason():
    with pytest.raises(EngineProcessError, match="no such model"):
        EngineProcess(broken)


def test_closing_the_proxy_ends_the_child(proc):
    pid = proc.pid
    proc.close()
    assert pid is not None and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False

"""An engine in its own process (vLLM v1's engine-core split) answers every call as
the engine itself would: the same tokens, the same refusals, weights loaded across the pipe; and
a child that dies makes the next call fail loudly instead of hanging."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from rlharvest.common.engine_types import EngineInputError, EngineRequest, SamplingParams
from rlharvest.common.worker_core.engine_process import EngineProcess, EngineProcessError
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from tests.builders import drain_tokens


def tiny(seed: int = 0) -> TorchEngine:
    """Top-level, so the spawned child can import and call it."""
    torch.set_num_threads(1)
    return TorchEngine("tiny", seed=seed, max_running=4, max_len=128)


class FailingEngine(TorchEngine):
    """The tiny engine, whose device is lost at its second step."""

    def step(self):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2:
            raise RuntimeError("device lost")
        return super().step()


def failing() -> TorchEngine:
    return FailingEngine("tiny", seed=0, max_running=4, max_len=128)


def broken() -> TorchEngine:
    raise RuntimeError("no such model")


def requests(n: int = 6) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=10 + i, seed=i))
            for i in range(n)]


def run(engine, batch: list[EngineRequest]) -> dict[str, list[int]]:
    for request in batch:
        engine.add(request)
    return drain_tokens(engine)


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


def take_steps(proc, got: dict[str, list[int]], n: int) -> None:
    """``n`` of the proxy's steps, each request's tokens added to ``got``."""
    for _ in range(n):
        for output in proc.step():
            got[output.request_id] += output.new_token_ids


def test_calls_between_steps_land_between_the_childs_steps_and_no_token_is_lost(proc):
    # The child runs one step ahead of its caller: an add or abort made between two of the
    # caller's steps lands after the step the child ran meanwhile. Tokens depend only on
    # (seed, position), so every request still gets its exact sequence.
    batch = requests(4)
    full = run(tiny(), batch)
    got: dict[str, list[int]] = defaultdict(list)
    proc.add(batch[0])
    proc.add(batch[1])
    take_steps(proc, got, 3)
    proc.add(batch[2])
    proc.add(batch[3])
    take_steps(proc, got, 2)
    assert proc.abort("r1").finish_reason == "abort"
    while proc.has_work():
        take_steps(proc, got, 1)
    assert {r: got[r] for r in ("r0", "r2", "r3")} == {r: full[r] for r in ("r0", "r2", "r3")}
    assert 5 <= len(got["r1"]) < len(full["r1"]) and got["r1"] == full["r1"][:len(got["r1"])]


def test_a_request_aborted_and_added_again_under_its_id_takes_no_token_of_the_ended_one(proc):
    # A migration sent straight back, or a client's retry with the same ids: the abort and the
    # add land between the same two steps, after the step the child ran ahead. That step's
    # token of the ended incarnation must not reach the new one (the hub routes by id only):
    # the stream the hub assembles is the uninterrupted run's, no token twice.
    batch = requests(2)
    full = run(tiny(), batch)
    got: dict[str, list[int]] = defaultdict(list)
    for request in batch:
        proc.add(request)
    take_steps(proc, got, 4)
    assert proc._conn.poll(10)  # the child ran the next step ahead: it waits in the pipe
    assert proc.abort("r0").finish_reason == "abort"
    proc.add(EngineRequest("r0", batch[0].prompt_token_ids, batch[0].sampling,
                           generated_token_ids=list(got["r0"])))
    while proc.has_work():
        take_steps(proc, got, 1)
    assert dict(got) == full  # r1's token in the step computed ahead is kept


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


def test_a_step_computed_before_a_weight_load_says_its_own_version_and_time(proc):
    proc.add(requests(1)[0])
    proc.step()
    assert proc._conn.poll(10)  # the child ran the next step ahead: it waits in the pipe
    proc.load_weights(tiny(seed=1).weights(), 7)
    assert proc.weight_version == 7
    assert proc.step() and proc.last_step_weight_version == 0  # computed by the old weights
    assert 0 < proc.last_step_seconds < 5


def test_a_child_that_dies_makes_the_next_call_fail_with_its_exit_code(proc):
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError, match="exit code -9"):
        proc.step()


def test_an_engine_step_that_raises_reaches_the_caller_and_ends_the_child():
    engine = EngineProcess(failing)
    try:
        engine.add(requests(1)[0])
        assert len(engine.step()) == 1
        with pytest.raises(EngineProcessError, match="device lost"):
            engine.step()
        with pytest.raises(EngineProcessError, match="device lost"):  # broken from then on
            engine.add(requests(2)[1])
        engine._proc.join(10)
        assert engine._proc.exitcode == 0  # it stopped on its own, nothing left stepping
    finally:
        engine.close()


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


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] != resource.RLIM_INFINITY
                    and resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 256,
                    reason="a hard open-file limit of 256 or less leaves nothing to raise")
def test_the_worker_raises_its_open_file_limit_for_the_weights_and_the_child_inherits_it():
    # In a process of its own: the limit is per process and this one's must stay as it was.
    script = (
        "import resource\n"
        "from rlharvest.common.worker_core.engine_process import EngineProcess\n"
        "from tests.unit.test_engine_process import tiny\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "proc = EngineProcess(tiny)\n"
        "mine = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "child = [l for l in open(f'/proc/{proc.pid}/limits') if l.startswith('Max open files')]\n"
        "proc.close()\n"
        "print(hard, mine, child[0].split()[3])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    hard, mine, child = out.stdout.split()
    expected = 65536 if hard == str(resource.RLIM_INFINITY) else min(65536, int(hard))
    assert int(mine) == int(child) == expected > 256

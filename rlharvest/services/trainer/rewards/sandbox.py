"""Run candidate Python code against stdin/stdout test cases in a limited subprocess.

Each test case runs in a fresh interpreter (``python -I``: no user site, no env-driven imports)
in an empty temporary directory with a scrubbed environment, under rlimits for CPU seconds
(RLIMIT_CPU), address space (RLIMIT_AS), written file size, processes and core dumps, plus a
wall-clock limit enforced from outside by killing the whole process group. The limits are set by
a small launcher inside the child before the candidate's code is compiled, which avoids
``preexec_fn`` (unsafe in a threaded parent such as the reward pool).

stdin, stdout and stderr are files in the work directory, not pipes: the file-size limit caps
what a candidate can print (a pipe would buffer it all in the trainer), and a grandchild that
leaves the process group cannot hold a pipe open and hang the reader. The group is killed
whenever the leader ends, before it is reaped, so nothing it started outlives the run; an alarm
inside the child is the backstop if the trainer itself dies mid-run.

Around that, Linux namespaces (``isolation.py``) take the network away, show the candidate only
its directory and the interpreter, and kill whatever it started with its PID namespace. The
trainer checks at start that they work here (``configure_isolation``) and refuses the code task
without them unless told to run with resource limits only. A container or gVisor around the
trainer is still the stronger boundary for code you have reason to fear.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from rlharvest.services.trainer.rewards import isolation

Status = Literal["passed", "wrong_answer", "runtime_error", "timeout", "cpu_limit", "memory_limit"]

_LAUNCHER = r"""
import resource, sys
cpu_s, mem_bytes, fsize_bytes, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
wall_s, nproc = int(sys.argv[5]), int(sys.argv[6])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))  # not enforced for root
import signal
signal.alarm(wall_s)  # backstop: the parent normally kills the group first
with open(path) as f:
    source = f.read()
sys.argv = [path]
exec(compile(source, path, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot isolate candidates here and running them unisolated was not allowed."""


_isolated = True  # namespaces around every run; configure_isolation may turn them off


def configure_isolation(allow_unisolated: bool) -> str:
    """Check that candidates can be isolated here; returns how they will run. Without
    isolation, raises SandboxUnavailable unless ``allow_unisolated`` (then: limits only)."""
    global _isolated
    why = isolation.available()
    if why is None:
        _isolated = True
        return "isolated: no network, a private filesystem view, its own PID namespace"
    if not allow_unisolated:
        raise SandboxUnavailable(
            f"the code sandbox cannot isolate candidate programs here ({why}); run the trainer "
            "where Linux namespaces are allowed, or pass --allow-unisolated-sandbox to run "
            "them with resource limits only")
    _isolated = False
    return f"NOT isolated, resource limits only ({why})"


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: float = 10.0  # rounded up to whole seconds (RLIMIT_CPU's unit)
    memory_bytes: int = 512 * 2**20  # address space, interpreter included
    file_bytes: int = 16 * 2**20
    output_bytes: int = 1 * 2**20  # stdout kept for comparison; more than this is a failure
    # RLIMIT_NPROC of the candidate's uid (isolated and run by root: a uid of its own).
    processes: int = 64
    disk_bytes: int = 64 * 2**20  # all it writes in its (isolated: tmpfs) work directory
    # All its processes' memory together, where the trainer may make a cgroup (root).
    total_memory_bytes: int = 1 << 30


@dataclass(frozen=True)
class StdioCase:
    case_id: str
    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class CaseResult:
    case_id: str
    status: Status
    elapsed_s: float  # wall time of the run, the quantity RollPacker's anchor tracks
    detail: str = ""  # tail of stderr, or why the run was stopped

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _classify(returncode: int, stdout: str, stderr: str, expected: str) -> tuple[Status, str]:
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit", f"killed by signal {-returncode} (CPU time limit)"
    if "MemoryError" in stderr:
        return "memory_limit", "MemoryError (address-space limit)"
    if returncode != 0:
        return "runtime_error", stderr[-500:]
    if stdout.strip() == expected.strip():
        return "passed", ""
    return "wrong_answer", f"got {stdout.strip()[:200]!r}"


def run_case(code: str, case: StdioCase, limits: SandboxLimits,
             clock: Callable[[], float] = time.perf_counter) -> CaseResult:
    """Run ``code`` with ``case.stdin``; never raises for anything the candidate does."""
    with tempfile.TemporaryDirectory(prefix="rlh-sandbox-") as tmp:
        workdir = os.path.realpath(tmp)  # the path the isolated candidate sees it under
        path, files = os.path.join(workdir, "candidate.py"), _stdio_paths(workdir)
        with open(path, "w") as f:
            f.write(code)
        with open(files["stdin"], "w") as f:
            f.write(case.stdin)
        argv = [sys.executable, "-I", "-c", _LAUNCHER, str(max(1, math.ceil(limits.cpu_s))),
                str(limits.memory_bytes), str(limits.file_bytes), path,
                str(math.ceil(limits.wall_s) + 2), str(limits.processes)]
        status_read, status_write = os.pipe() if _isolated else (-1, -1)
        cgroup = isolation.case_cgroup(limits.total_memory_bytes, limits.processes) \
            if _isolated else None
        if _isolated:
            argv = isolation.isolated_argv(workdir, argv, status_write, limits.disk_bytes,
                                           cgroup)
        start = clock()
        try:
            with open(files["stdin"], "rb") as stdin, open(files["stdout"], "wb") as stdout, \
                    open(files["stderr"], "wb") as stderr:
                proc = subprocess.Popen(
                    argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=workdir,
                    start_new_session=True, env=isolation.SANDBOX_ENV,
                    pass_fds=(status_write,) if _isolated else ())
        except BaseException:
            if _isolated:
                os.close(status_read)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            if _isolated:
                os.close(status_write)  # ours; the namespace's PID 1 holds its own
        finished = _wait_unreaped(proc.pid, limits.wall_s)
        _kill_group(proc)  # the leader is not reaped yet: its group id cannot have been reused
        proc.wait()
        out_of_memory = cgroup is not None and cgroup.out_of_memory()
        if cgroup is not None:
            cgroup.remove()
        elapsed = clock() - start
        returncode = proc.returncode
        if _isolated:
            returncode = isolation.reported_status(status_read, returncode)
            os.close(status_read)
        if not finished:
            return CaseResult(case.case_id, "timeout", elapsed,
                              f"exceeded the {limits.wall_s:.3g}s wall-clock limit")
        try:
            out = _read_text(files["stdout"], limits.output_bytes + 1)
            err = _read_text(files["stderr"], 64 * 1024)
        except _ReplacedOutput as exc:
            return CaseResult(case.case_id, "runtime_error", elapsed,
                              f"the program replaced its output file ({exc})")
    if len(out) > limits.output_bytes:
        return CaseResult(case.case_id, "runtime_error", elapsed,
                          f"printed more than {limits.output_bytes} bytes")
    status, detail = _classify(returncode, out, err, case.expected_stdout)
    if out_of_memory and status != "passed":  # a SIGKILL from the cgroup, not the CPU limit
        status, detail = "memory_limit", (f"its processes together passed the "
                                          f"{limits.total_memory_bytes} bytes of the case")
    return CaseResult(case.case_id, status, elapsed, detail)


def _stdio_paths(workdir: str) -> dict[str, str]:
    return {name: os.path.join(workdir, name) for name in ("stdin", "stdout", "stderr")}


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` exits without reaping it (WNOWAIT); False on timeout."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


class _ReplacedOutput(Exception):
    """The program put something else than a file at its stdout or stderr path."""


def _read_text(path: str, limit: int) -> str:
    # The work directory is the candidate's: the path may now be a FIFO (an open would block
    # this thread for good), a symlink to a host file the trainer may read, or gone. Only the
    # regular file the sandbox made is read. Bytes, then a lenient decode: a candidate printing
    # invalid UTF-8 is a wrong answer, not a crash of the reward function.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise _ReplacedOutput(f"{os.path.basename(path)}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _ReplacedOutput(f"{os.path.basename(path)} is no longer a file")
        return f.read(limit).decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    # The candidate may have forked; its whole session goes.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_tests(code: str, cases: Sequence[StdioCase],
              limits_for: Callable[[StdioCase], SandboxLimits], stop_at_first_failure: bool = True,
              clock: Callable[[], float] = time.perf_counter) -> list[CaseResult]:
    """Run the cases in order; ``limits_for`` picks each case's limits (e.g. an adaptive wall
    timeout). With ``stop_at_first_failure`` an all-or-nothing reward stops paying early."""
    results = []
    for case in cases:
        result = run_case(code, case, limits_for(case), clock)
        results.append(result)
        if stop_at_first_failure and not result.passed:
            break
    return results

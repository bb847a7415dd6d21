"""A fork server: one process imports the services' heavy libraries (torch, transformers; never
gRPC, see ``serve``) once, then forks each service process from that state instead of starting
a fresh interpreter.

A trainer's imports take 5–6 s of CPU and a worker's 2–3 s; the integration suite starts a few
hundred service processes on 2 cores, so most of its time went to importing torch again. What
the fork server starts is still a real process of its own (its own pid, session and log file;
SIGKILL kills it, SIGTERM drains it), running the service's ``__main__`` exactly as
``python -m <module>`` would — the Android zygote's idea, which vLLM and SGLang skip only
because a CUDA context cannot be forked. Nothing here touches a GPU: the server only imports.

The server is a child of the process that started it and leaves when that process does. It
reaps its children only when asked for their status, so a pid is never reused while a client
holds a handle to it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Environment keys that may differ between the server and a service it forks: read by the
# service's own config after the fork, never at import time. Any other difference (PYTHONPATH,
# OMP_NUM_THREADS, LD_*, ...) could have changed what the imports did, so that service is
# started as a fresh interpreter instead.
FORKABLE_ENV_PREFIXES = ("RLH_", "PYTEST_")

_PARENT_CHECK_S = 1.0
_POLL_INTERVAL_S = 0.02


class ForkServerGone(RuntimeError):
    """The fork server died; the services it started run on, but their exit status is lost."""


class ForkServer:
    """Client of a fork server process that has imported ``preload``."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.preload = tuple(preload)
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="rlh-fork-")
        self.socket_path = os.path.join(self._dir, "server.sock")
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ForkServer:
        """Start the server and wait until it has imported everything and listens."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "rlharvest.common.fork_server", self.socket_path, *self.preload],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        with self._process.stdout as ready:  # one line, then never read again: closed
            # "ready", or nothing: the server died (its stderr says why) or hangs importing.
            line = ready.readline() if select.select([ready], [], [], timeout)[0] else ""
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"fork server failed to start within {timeout:g}s "
                               f"(preloading {self.preload})")
        return self

    def can_fork(self, env: Mapping[str, str]) -> bool:
        """Whether a service with this environment may be forked rather than started fresh."""
        if self._process is None or self._process.poll() is not None:
            return False
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith(FORKABLE_ENV_PREFIXES) for k in changed)

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str],
              log_path: Path) -> ForkedProcess:
        """Fork ``python -m module *args`` in a new session, its output appended to ``log_path``."""
        reply = self._request({"op": "spawn", "module": module, "args": list(args),
                               "env": dict(env), "cwd": os.getcwd(), "log": str(log_path)})
        if "error" in reply:
            raise RuntimeError(f"fork server could not start {module}: {reply['error']}")
        return ForkedProcess(self, int(reply["pid"]), [module, *args])

    def status(self, pid: int) -> int | None:
        """The exit code of a process this server forked (negative: killed by that signal), or
        None while it runs."""
        return self._request({"op": "poll", "pid": pid})["returncode"]

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30.0)
                conn.connect(self.socket_path)
                conn.sendall(json.dumps(message).encode() + b"\n")
                reply = conn.makefile("rb").readline()
        except OSError as exc:
            raise ForkServerGone(str(exc)) from exc
        if not reply:
            raise ForkServerGone("the fork server closed the connection")
        return json.loads(reply)


class ForkedProcess:
    """The part of ``subprocess.Popen``'s interface the launcher and the tests use, for a
    process the fork server started (not a child of this one, so ``waitpid`` cannot see it)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.server.status(self.pid)
            except ForkServerGone:
                # Its parent is gone, so init reaps it: alive or not is all that is knowable.
                if not _running(self.pid):
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_INTERVAL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# --- the server process -------------------------------------------------------------------------


def serve(socket_path: str, preload: Sequence[str]) -> None:
    for module in preload:
        importlib.import_module(module)
    if "grpc" in sys.modules:
        # Measured: a child forked after gRPC's import took a minute to see that the peer of
        # its stream had been SIGKILLed (a fresh interpreter sees it at once). The services
        # import gRPC themselves, after the fork.
        raise SystemExit(f"fork server: preloading {list(preload)} imported grpc; it must not")
    # Objects made so far are never collected in the children: freezing them keeps the
    # collector from touching (and so copying) their pages in every forked process.
    gc.collect()
    gc.freeze()
    parent = os.getppid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(socket_path)
        listener.listen(128)
        listener.settimeout(_PARENT_CHECK_S)
        print("ready", flush=True)
        while os.getppid() == parent:  # the client is gone: so is the server
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                _answer(conn, listener)


def _answer(conn: socket.socket, listener: socket.socket) -> None:
    conn.settimeout(30.0)
    try:
        request = json.loads(conn.makefile("rb").readline())
        if request["op"] == "spawn":
            reply: dict[str, Any] = {"pid": _fork_service(request, conn, listener)}
        else:
            reply = {"returncode": _reap(int(request["pid"]))}
    except Exception as exc:  # noqa: BLE001 - a bad request must not end the server
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(reply).encode() + b"\n")


def _reap(pid: int) -> int | None:
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -signal.SIGKILL  # reaped before (asked twice): it is gone
    return None if done == 0 else os.waitstatus_to_exitcode(status)


def _fork_service(request: dict[str, Any], conn: socket.socket, listener: socket.socket) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    session_made, session_told = os.pipe()
    pid = os.fork()
    if pid:
        # The pid goes out once the child leads its own session (as Popen's returns after the
        # exec): a caller's killpg(pid) right away must find the group.
        os.close(session_told)
        os.read(session_made, 1)  # b"" once the child closed its end (or died)
        os.close(session_made)
        return pid
    code = 70  # EX_SOFTWARE: the child failed before the service ran
    try:
        os.close(session_made)
        conn.close()
        listener.close()
        os.setsid()
        os.close(session_told)
        code = _become(request)
    finally:
        os._exit(code)


def _become(request: dict[str, Any]) -> int:
    """In the forked child (its own session already): take the request's log, environment and
    argv, run the module as ``__main__``, exit as the interpreter would; the exit code."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((null, 0), (log, 1), (log, 2)):
        os.dup2(src, dst)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    sys.modules.pop(request["module"], None)  # preloaded: runpy would warn it runs twice
    code, interrupted = 0, False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - reported as an interpreter would, exit code 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    _finalize()
    if interrupted:  # a fresh interpreter dies of an unhandled SIGINT, after its cleanup
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _finalize() -> None:
    """What the interpreter does at exit before its own teardown, in its order: wait for
    non-daemon threads (a pool's last write finishes, as it would in a fresh process), run
    the threading exit hooks and the atexit handlers, flush."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])

"""Linux namespaces around a sandboxed candidate: no network, a private filesystem view, and
nothing left behind.

``isolated_argv`` wraps the sandbox's launcher command in ``unshare`` (util-linux; bubblewrap
is not needed): new network, mount, PID, IPC and UTS namespaces (plus a user namespace when
not root). Inside, a small setup program builds a fresh root on a tmpfs holding only the
interpreter's directories, read-only (``/usr`` and the Python prefix), the candidate's work
directory (read-write), ``/proc`` and three device nodes, ``chroot``s into it and ``exec``s the
launcher. So the candidate

- cannot open a socket to anywhere: its network namespace has no interface up, loopback
  included;
- cannot read a file outside its directory and the interpreter: nothing else is mounted in its
  root (the trainer's checkpoints, data and keys are not there);
- leaves no process behind: it is PID 1's descendant in its own PID namespace, and every
  process of a PID namespace dies with its PID 1 (``--kill-child`` also kills that one when
  ``unshare`` itself is killed).

``available()`` probes once whether the kernel and the user may do this; the trainer refuses
the code task without it unless ``--allow-unisolated-sandbox``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile

_SETUP = r"""
import os, subprocess, sys, tempfile
workdir, prefix, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
def mount(*args):
    subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL)
mount("--make-rprivate", "/")
root = tempfile.mkdtemp(prefix="rlh-root-")
mount("-t", "tmpfs", "-o", "size=8m,mode=755", "tmpfs", root)
for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr links, as on the host
    if os.path.islink(top):
        os.symlink(os.readlink(top), root + top)
for path in ("/usr", prefix):  # the interpreter, read-only
    os.makedirs(root + path, exist_ok=True)
    mount("--rbind", path, root + path)
    mount("-o", "remount,bind,ro", root + path)
os.makedirs(root + workdir)
mount("--bind", workdir, root + workdir)
os.makedirs(root + "/proc")
mount("-t", "proc", "proc", root + "/proc")
os.makedirs(root + "/dev")
for node in ("null", "zero", "urandom"):
    open(root + "/dev/" + node, "w").close()
    mount("--bind", "/dev/" + node, root + "/dev/" + node)
os.makedirs(root + "/tmp", exist_ok=True)
os.chroot(root)
os.chdir(workdir)
# PID 1 of the namespace waits for the launcher and reports a signal death as 128 + signal
# (unshare's own relay of signals such as SIGXCPU is unreliable); when PID 1 exits, every
# process left in the namespace is killed.
child = os.fork()
if child == 0:
    os.execv(argv[0], argv)
code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
sys.exit(128 - code if code < 0 else code)
"""


def _python_prefix() -> str:
    """The directory holding the interpreter and its standard library."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return prefix if executable.startswith(prefix + os.sep) else os.path.dirname(executable)


def isolated_argv(workdir: str, argv: list[str]) -> list[str]:
    """``argv`` (an absolute interpreter path first) run isolated with ``workdir`` its only
    writable, and only visible non-interpreter, directory. Its exit status comes back as is,
    a death by signal N as exit status 128 + N (``signal_of``)."""
    unshare = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--ipc",
               "--uts", *([] if os.geteuid() == 0 else ["--map-root-user"])]
    return [*unshare, sys.executable, "-I", "-c", _SETUP, workdir, _python_prefix(), *argv]


@functools.cache
def available() -> str | None:
    """None when isolation works here, else why not (probed once: a no-op run)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "util-linux's unshare and mount are not installed"
    with tempfile.TemporaryDirectory(prefix="rlh-probe-") as workdir:
        try:
            done = subprocess.run(isolated_argv(os.path.realpath(workdir),
                                                [sys.executable, "-I", "-c", "pass"]),
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the namespace probe failed: {exc}"
    if done.returncode != 0:
        return f"the kernel or this user refuses namespaces: {done.stderr.strip()[-300:]}"
    return None


def signal_of(returncode: int) -> int:
    """The returncode an isolated run would have had unisolated: 128 + N is a death by N."""
    return -(returncode - 128) if 128 < returncode < 160 else returncode

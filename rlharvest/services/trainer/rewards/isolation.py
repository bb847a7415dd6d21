"""Linux namespaces around a sandboxed candidate: no network, a private filesystem view, and
nothing left behind.

``isolated_argv`` wraps the sandbox's launcher command in ``unshare`` (util-linux; bubblewrap
is not needed): new network, mount, PID, IPC and UTS namespaces (plus a user namespace when
not root). Inside, a small setup program builds a fresh root on a tmpfs holding only the
interpreter's directories, read-only (``/usr`` and the Python prefix), the candidate's work
directory (read-write), ``/proc`` and three device nodes, ``pivot_root``s into it and detaches
the old root, and runs the launcher with no capabilities (``setpriv``: empty bounding set, no
new privileges). So the candidate

- cannot open a socket to anywhere: its network namespace has no interface up, loopback
  included;
- cannot read a file outside its directory and the interpreter: nothing else is mounted in its
  root (the trainer's checkpoints, data and keys are not there), the host's root is unmounted,
  and without capabilities it cannot mount, chroot or remount the interpreter writable;
- leaves no process behind: it is PID 1's descendant in its own PID namespace, and every
  process of a PID namespace dies with its PID 1 (``--kill-child`` also kills that one when
  ``unshare`` itself is killed).

``available()`` probes once whether the kernel and the user may do this; the trainer refuses
the code task without it unless ``--allow-unisolated-sandbox``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_SETUP = r"""
import os, shutil, subprocess, sys
workdir, prefix, status_fd, uid, disk = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
cgroups, argv = [p for p in sys.argv[6].split(",") if p], sys.argv[7:]
for procs in cgroups:  # into the case's cgroups first: everything after is counted there
    with open(procs, "w") as f:
        f.write("0")
os.environ["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"  # mount, pivot_root, umount
def run(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
run("mount", "--make-rprivate", "/")
root = os.path.join(workdir, ".root")  # inside the work directory: removed with it
os.mkdir(root)
run("mount", "-t", "tmpfs", "-o", "size=8m,mode=755", "tmpfs", root)
for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr links, as on the host
    if os.path.islink(top):
        os.symlink(os.readlink(top), root + top)
# The interpreter, read-only: /usr, and its prefix unless that is /usr itself (a prefix below
# /usr is mounted again so that it is read-only even when it is a mount of its own).
for path in ["/usr"] + ([] if prefix == "/usr" else [prefix]):
    os.makedirs(root + path, exist_ok=True)
    run("mount", "--rbind", path, root + path)
    run("mount", "-o", "remount,bind,ro", root + path)
os.makedirs(root + workdir)
# The work directory is a tmpfs of its own holding copies of the trainer's files: what the
# candidate writes there is bounded in total (RLIMIT_FSIZE bounds one file), never reaches the
# host's disk, and cannot replace the files the trainer reads back (it writes its output
# through the descriptors it was handed).
run("mount", "-t", "tmpfs", "-o", f"size={disk},mode=700", "tmpfs", root + workdir)
for name in os.listdir(workdir):
    if name != ".root":
        shutil.copyfile(os.path.join(workdir, name), root + workdir + "/" + name)
        if uid >= 0:
            os.chown(root + workdir + "/" + name, uid, uid)
if uid >= 0:
    os.chown(root + workdir, uid, uid)
os.makedirs(root + "/proc")
# Read-only: procfs lets uid 0 write sysctls (/proc/sys) and /proc/sysrq-trigger by file mode,
# with no capability, and /proc/sys is the host's outside the net and UTS namespaces. A trainer
# run as root (no user namespace) would hand a candidate kernel.core_pattern (a command run as
# root on the host at the next crash dump).
run("mount", "-t", "proc", "-o", "ro,nosuid,nodev,noexec", "proc", root + "/proc")
os.makedirs(root + "/dev")
for node in ("null", "zero", "urandom"):
    open(root + "/dev/" + node, "w").close()
    run("mount", "--bind", "/dev/" + node, root + "/dev/" + node)
os.makedirs(root + "/tmp", exist_ok=True)
# pivot_root, then detach the old root: unlike a chroot, nothing of the host tree stays
# reachable (a chroot can be climbed out of by whoever may chroot again).
os.mkdir(root + "/.old")
os.chdir(root)
run("pivot_root", ".", ".old")
os.chdir("/")
run("umount", "-l", "/.old")
os.rmdir("/.old")
os.chdir(workdir)
# PID 1 of the namespace waits for the candidate and writes its exit status (negative: the
# signal that killed it) to the status pipe, which the candidate never holds: an exit code is
# not enough, since a candidate may exit with 128 + N itself (unshare's own relay of signals
# such as SIGXCPU is unreliable too). When PID 1 exits, every process left in the namespace is
# killed. The candidate runs with no capability at all (an empty bounding set, no new
# privileges): it can neither mount, nor chroot, nor remount the read-only interpreter writable.
child = os.fork()
if child == 0:
    if status_fd >= 0:
        os.close(status_fd)
    # Run by root, the candidate gets a uid of its own: the kernel does not enforce
    # RLIMIT_NPROC for root, and every process of a uid counts against it.
    user = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid >= 0 else []
    os.execv("/usr/bin/setpriv", ["setpriv", "--no-new-privs", "--bounding-set=-all",
                                  "--inh-caps=-all", *user, "--", *argv])
code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
if status_fd >= 0:
    os.write(status_fd, str(code).encode())
sys.exit(1 if code < 0 else code)
"""


# The environment sandboxed runs (and the probe) start with.
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


@functools.cache
def _python_prefix() -> str:
    """The directory holding the interpreter and its standard library."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return prefix if executable.startswith(prefix + os.sep) else os.path.dirname(executable)


# Run by root, each candidate runs as a uid drawn from here (no account needs to exist): two
# runs at once share one only by chance, and then only their process limit.
_UID_BASE, _UID_SPAN = 1 << 20, 1 << 20


def isolated_argv(workdir: str, argv: list[str], status_fd: int = -1,
                  disk_bytes: int = 64 * 2**20, cgroup: CaseCgroup | None = None) -> list[str]:
    """``argv`` (an absolute interpreter path first) run isolated with ``workdir`` its only
    writable, and only visible non-interpreter, directory: a tmpfs of ``disk_bytes`` holding
    copies of its files. Its exact exit status (negative: a death by that signal) is written to
    ``status_fd`` (a pipe's write end the caller passes through, ``reported_status``); the
    process's own exit code is 1 for a death by signal. Run by root, the candidate runs as an
    unprivileged uid of its own, so its process limit holds; with ``cgroup`` it runs in that
    cgroup, which bounds its processes' memory together."""
    root = os.geteuid() == 0
    unshare = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--ipc",
               "--uts", *([] if root else ["--map-root-user"])]
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if root else -1
    # The real interpreter, not a virtualenv's link to it (the venv is not mounted inside).
    inner = [os.path.realpath(argv[0]), *argv[1:]]
    return [*unshare, sys.executable, "-I", "-c", _SETUP, workdir, _python_prefix(),
            str(status_fd), str(uid), str(disk_bytes),
            ",".join(cgroup.procs() if cgroup is not None else []), *inner]


_CGROUPS = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CaseCgroup:
    """A cgroup of one sandboxed case: all its processes together get at most ``memory_bytes``
    of memory and ``processes`` processes (RLIMIT_AS bounds one process, RLIMIT_NPROC a uid).
    cgroup v1's memory and pids hierarchies, or one v2 cgroup under the hierarchy's root."""

    paths: tuple[Path, ...]

    def procs(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.paths]

    def out_of_memory(self) -> bool:
        """Whether the memory limit killed one of its processes (read before ``remove``)."""
        for path in self.paths:
            v1 = _read(path / "memory.oom_control")
            if "oom_kill " in v1 and not v1.split("oom_kill ")[1].startswith("0"):
                return True
            events = _read(path / "memory.events")
            if "oom_kill " in events and not events.split("oom_kill ")[1].startswith("0"):
                return True
            if _read(path / "memory.failcnt").strip() not in ("", "0"):
                return True
        return False

    def remove(self) -> None:
        """Gone once its processes are (the PID namespace's end kills them); a cgroup whose
        last process is still exiting refuses removal for a moment."""
        for path in self.paths:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def case_cgroup(memory_bytes: int, processes: int) -> CaseCgroup | None:
    """A new cgroup for one case, or None where this process may not make one (not root, no
    writable cgroup hierarchy): the limits per process remain."""
    if os.geteuid() != 0:
        return None
    name = f"rlharvest-sandbox/case-{secrets.token_hex(6)}"
    v1 = {"memory": {"memory.limit_in_bytes": memory_bytes}, "pids": {"pids.max": processes}}
    paths = [p for controller, limits in v1.items()
             if (p := _make(_CGROUPS / controller / name, limits)) is not None]
    if not paths and "memory" in _read(_CGROUPS / "cgroup.subtree_control"):  # v2
        limits = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": processes}
        paths = [p for p in [_make(_CGROUPS / name, limits)] if p is not None]
    return CaseCgroup(tuple(paths)) if paths else None


def _make(path: Path, limits: dict[str, int]) -> Path | None:
    try:
        path.mkdir(parents=True)
        for name, value in limits.items():
            (path / name).write_text(str(value))
        return path
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@functools.cache
def available() -> str | None:
    """None when isolation works here, else why not (probed once: a no-op run)."""
    if any(shutil.which(tool) is None for tool in ("unshare", "mount", "pivot_root", "umount")) \
            or not os.access("/usr/bin/setpriv", os.X_OK):
        return "util-linux's unshare, mount, pivot_root, umount and setpriv are not all installed"
    with tempfile.TemporaryDirectory(prefix="rlh-probe-") as workdir:
        try:
            done = subprocess.run(isolated_argv(os.path.realpath(workdir),
                                                [sys.executable, "-I", "-c", "pass"]),
                                  capture_output=True, text=True, timeout=30, env=SANDBOX_ENV)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the namespace probe failed: {exc}"
    if done.returncode != 0:
        return f"the kernel or this user refuses namespaces: {done.stderr.strip()[-300:]}"
    return None


def reported_status(read_fd: int, returncode: int) -> int:
    """The candidate's exit status as the namespace's PID 1 wrote it to the status pipe (every
    writer is gone once the run ended, so this never blocks); ``returncode`` when it wrote none
    (the isolation's setup failed, or the run was killed first)."""
    written = os.read(read_fd, 32)
    return int(written) if written.strip().lstrip(b"-").isdigit() else returncode

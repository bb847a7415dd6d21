"""Paths a caller names inside one directory, and nowhere else.

A service that opens files named by an RPC (the worker's ``LoadWeights``) must not become a way
to read the host's files: the name is taken relative to a configured root, and a name that is
absolute, climbs out with ``..``, or leads out through a symlink is refused before anything is
opened. The check resolves symlinks, so a link inside the root to a file outside it is refused
too; a link that stays inside is fine.

A checked path is only a name, though: a directory on it may be swapped for a symlink out of
the root between the check and the open. ``open_confined`` closes that gap: it opens the file
and checks where the kernel actually opened it (the descriptor's own path), and whoever reads
it reads that open file, never the name again (``descriptor_path`` for libraries that take a
path).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from rlharvest.common.errors import FailedPrecondition, InvalidArgument, NotFound, quoted

# The OS's own limits (Linux PATH_MAX and NAME_MAX), checked before any filesystem call: a name
# beyond them cannot name a file, and resolving a 200 KB name of short components cost seconds
# (a cost that grows with the square of the components).
MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255


def _bounded(name: str, what: str) -> None:
    if "\0" in name:
        raise InvalidArgument(f"{quoted(name)} holds a NUL byte; name a {what} without one")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > MAX_PATH_BYTES:
        raise InvalidArgument(f"the {what} name is {size} bytes, over the {MAX_PATH_BYTES} a "
                              f"path may have: {quoted(name)}")
    longest = max((len(part.encode("utf-8", "surrogateescape")) for part in name.split("/")),
                  default=0)
    if longest > MAX_COMPONENT_BYTES:
        raise InvalidArgument(f"{quoted(name)} has a component of {longest} bytes, over the "
                              f"{MAX_COMPONENT_BYTES} a file name may have")


def confined_path(root: str | Path, name: str, what: str = "file") -> Path:
    """``name`` resolved under ``root``. Raises FailedPrecondition when no root is configured
    and InvalidArgument for a name that is empty, over the OS's path limits, absolute, has a
    ``..`` part, or resolves (symlinks followed) outside the root. Existence is the caller's
    check. It touches the filesystem: call it off an event loop."""
    if not str(root):
        raise FailedPrecondition(f"this service reads no {what} named by a caller: start it with "
                                 "a directory to read from (weights_dir)")
    if not name:
        raise InvalidArgument(f"name a {what} relative to the service's directory")
    _bounded(name, what)
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute():
        raise InvalidArgument(f"{quoted(name)} is an absolute path; name a {what} relative to the "
                              "service's directory")
    if ".." in pure.parts:
        raise InvalidArgument(f"{quoted(name)} climbs out of the service's directory with '..'")
    try:
        base = Path(root).resolve()
        target = (base / name).resolve()
    except (ValueError, RuntimeError, OSError) as exc:  # a NUL byte, a symlink loop
        raise InvalidArgument(f"{quoted(name)} is not a usable path: {exc}") from None
    if not _within(base, target):
        raise InvalidArgument(f"{quoted(name)} leads outside the service's directory (a "
                              "symlink)")
    return target


def _within(base: Path, path: Path) -> bool:
    return path == base or base in path.parents


def open_confined(root: str | Path, name: str, what: str = "file") -> BinaryIO:
    """The regular file ``name`` under ``root``, open for reading: ``confined_path``'s checks,
    then the open, then the same containment check on the path of the file actually opened, so
    a name swapped for a symlink out after the check is refused, not read through. Raises what
    ``confined_path`` raises, and NotFound when no regular file is there (a FIFO or device is
    never read: it is opened without blocking, then refused)."""
    target = confined_path(root, name, what)
    base = Path(root).resolve()
    try:
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise NotFound(f"no {what} {quoted(name)} in the service's directory: "
                       f"{exc.strerror}") from None
    try:
        opened = _opened_path(fd)
        if not _within(base, opened):
            raise InvalidArgument(f"{quoted(name)} leads outside the service's directory (a symlink "
                                  "swapped in after it was checked)")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotFound(f"{quoted(name)} is no {what} in the service's directory (not a file)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def descriptor_path(file: BinaryIO) -> str:
    """A path that names ``file``'s open descriptor itself (Linux ``/proc/self/fd``, else
    ``/dev/fd``), for a library that takes a path: opening it opens the file already open, not
    whatever its name leads to now. Valid while ``file`` is open."""
    fd = file.fileno()
    return f"/proc/self/fd/{fd}" if sys.platform.startswith("linux") else f"/dev/fd/{fd}"


def _opened_path(fd: int) -> Path:
    """Where the kernel opened ``fd``, symlinks resolved as it followed them."""
    if sys.platform.startswith("linux"):
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    import fcntl

    if hasattr(fcntl, "F_GETPATH"):  # macOS
        raw = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(os.pathconf(".", "PC_PATH_MAX")))
        return Path(os.fsdecode(raw.split(b"\0", 1)[0]))
    raise FailedPrecondition("this platform cannot tell where an open file lies; files named by "
                             "a caller are read only on Linux and macOS")

"""Paths a caller names inside one directory, and nowhere else.

A service that opens files named by an RPC (the worker's ``LoadWeights``) must not become a way
to read the host's files: the name is taken relative to a configured root, and a name that is
absolute, climbs out with ``..``, or leads out through a symlink is refused before anything is
opened. The check resolves symlinks, so a link inside the root to a file outside it is refused
too; a link that stays inside is fine.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from rlharvest.common.errors import FailedPrecondition, InvalidArgument


def confined_path(root: str | Path, name: str, what: str = "file") -> Path:
    """``name`` resolved under ``root``. Raises FailedPrecondition when no root is configured
    and InvalidArgument for a name that is empty, absolute, has a ``..`` part, or resolves
    (symlinks followed) outside the root. Existence is the caller's check."""
    if not str(root):
        raise FailedPrecondition(f"this service reads no {what} named by a caller: start it with "
                                 "a directory to read from (weights_dir)")
    if not name:
        raise InvalidArgument(f"name a {what} relative to the service's directory")
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute():
        raise InvalidArgument(f"{name!r} is an absolute path; name a {what} relative to the "
                              "service's directory")
    if ".." in pure.parts:
        raise InvalidArgument(f"{name!r} climbs out of the service's directory with '..'")
    try:
        base = Path(root).resolve()
        target = (base / name).resolve()
    except (ValueError, RuntimeError, OSError) as exc:  # a NUL byte, a symlink loop
        raise InvalidArgument(f"{name!r} is not a usable path: {exc}") from None
    if target != base and base not in target.parents:
        raise InvalidArgument(f"{name!r} leads outside the service's directory (a symlink)")
    return target

"""Loading user code named ``package.module:attribute`` (reward functions, environments)."""

from __future__ import annotations

import importlib


def load_object(spec: str, what: str, shape: str = "name") -> object:
    """The attribute ``spec`` names, or ValueError saying why it cannot be loaded."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'package.module:{shape}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {what} {spec!r}: {exc}; "
                         "is it installed / on PYTHONPATH?") from exc
    value = getattr(module, attr, None)
    if value is None:
        raise ValueError(f"{module_name!r} has no {attr!r} (from {spec!r})")
    return value

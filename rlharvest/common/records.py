"""Records kept in etcd as JSON objects: the one parser every record kind starts from (pure, no
etcd client: the managers' pure accounting modules use it)."""

from __future__ import annotations

import json
from typing import Any


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    """A stored JSON record as a dict; ValueError naming ``what`` when it is not one."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"the {what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the {what} is not a JSON object: {raw[:200]!r}")
    return data

"""The lending record of a serving co-executor (ROSE §5), read and written in one place.

``keys.lending_key(coexec_id)`` holds ``{"job": ..., "manager": ...}``: the job that borrowed
the co-executor and the manager that claimed it. The manager creates it only if absent (one job
per co-executor) on its own lease; the co-executor serves that job's rollouts while it exists.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    job: str
    manager: str

    def encode(self) -> bytes:
        return json.dumps({"job": self.job, "manager": self.manager}).encode()


def parse_claim(raw: bytes | None) -> Claim | None:
    """The claim in ``raw``; None when absent or malformed (logged): a bad write lends nothing."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        job, manager = record["job"], record["manager"]
        if isinstance(job, str) and job and isinstance(manager, str) and manager:
            return Claim(job, manager)
    except (ValueError, KeyError, TypeError):
        pass
    log.error("ignoring a malformed lending record %r: expected {\"job\": str, \"manager\": "
              "str}", raw[:200])
    return None

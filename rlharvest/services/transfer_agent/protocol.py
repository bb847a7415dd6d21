"""What the transfer agent's server and its callers agree on beyond the proto: the gRPC
service's name, the trailing-metadata key that carries the HTTP data endpoint, the role an
agent's certificate names, and how a plan is identified. The server (service.py, main.py), the
HTTP data path and the client import these from here, so no side imports another for a
constant."""

from __future__ import annotations

import zlib

from rlharvest.common.authorization import SERVICE_ROLES
from rlharvest.common.pb import transfer_agent_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TransferAgent"].full_name
# PlanPull's trailing metadata: where the plan's bucket bytes are served over HTTP (a proto
# field would need a new message version on every caller).
DATA_ENDPOINT_METADATA = "rlh-data-endpoint"
AGENT_ROLE = SERVICE_ROLES["transfer_agent"]  # what a weight holder's certificate names


def manifest_id(manifest_json: str) -> int:
    """A plan's id: the CRC-32 of its manifest, so a puller quoting it proves it planned
    against the same buckets the agent still serves."""
    return zlib.crc32(manifest_json.encode()) & 0xFFFFFFFF

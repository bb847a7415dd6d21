"""A real process that registers a member (or campaigns for leadership) and then sleeps until it
is killed; the registry tests SIGKILL it to prove lease expiry and election failover."""

import asyncio
import sys

from rlharvest.common import registry


async def main(endpoint: str, mode: str, name: str, ttl: int) -> None:
    client = await registry.connect(endpoint)
    if mode == "member":
        await registry.register(client, "rollout_worker", name, {"endpoint": "x:1"}, ttl=ttl)
    else:
        await registry.Election(client, "test-election", name, ttl=ttl).campaign()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))

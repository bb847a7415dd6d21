"""Membership, watches, leader election and versioned records in etcd (aetcd, asyncio).

Liveness is a lease: a member's key is attached to its lease, and disappears within the lease TTL
once the member stops renewing (a SIGKILL included). Watchers see that as a ``leave`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import aetcd
import aetcd.client
import aetcd.rpc
import aetcd.watcher
import grpc
from aetcd.utils import prefix_range_end

from rlharvest.common import keys, tls
from rlharvest.common.aio import wait_event
from rlharvest.common.config import ConfigError
from rlharvest.common.etcd_outage import etcd_answered, etcd_away, etcd_failed, with_etcd

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """Where etcd listens; ``tls``: it speaks TLS (the endpoint was given as ``https://``)."""

    host: str
    port: int
    tls: bool = False


_SCHEMES = {"": False, "http": False, "https": True}  # scheme -> dial TLS


def parse_endpoint(endpoint: str) -> Endpoint:
    """``host:port`` or ``http://host:port`` (plaintext), ``https://host:port`` (TLS): the
    scheme etcd's own flags and ``etcdctl --endpoints`` use."""
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        scheme, address = "", endpoint
    host, sep, port = address.rstrip("/").rpartition(":")
    if scheme.lower() not in _SCHEMES or not sep or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} must look like host:port, "
                         "http://host:port or https://host:port")
    return Endpoint(host or "127.0.0.1", int(port), _SCHEMES[scheme.lower()])


def check_endpoint(endpoint: str) -> Endpoint:
    """The parsed endpoint, once this process can dial it: an ``https://`` one needs the
    process's TLS material (``tls.configure``). Raises ConfigError (a ValueError) naming the
    keys to set, so a missing setting is not mistaken for a refused handshake."""
    target = parse_endpoint(endpoint)
    if target.tls and tls.active() is None:
        raise ConfigError(f"etcd endpoint {endpoint} is https: set tls_ca (the CA that signed "
                          "etcd's certificate), tls_cert and tls_key (this process's "
                          "certificate, which etcd's --client-cert-auth checks)")
    return target


# etcd authentication for every client this process opens (set once at start, like TLS).
_credentials: tuple[str, str] | None = None
_token_renew_s = 30.0


def use_credentials(username: str, password: str, token_renew_s: float = 30.0) -> None:
    """etcd user and password for every later ``connect`` of this process (both empty: none),
    and how often its clients fetch a fresh auth token (``AuthenticatingClient``)."""
    global _credentials, _token_renew_s
    _credentials = (username, password) if username or password else None
    _token_renew_s = token_renew_s


class AuthenticatingClient(aetcd.Client):
    """aetcd's client, over TLS when given ``channel_credentials``, fetching a fresh auth
    token every ``token_renew_s``.

    TLS: aetcd 1.0's ``connect`` hard-codes a plaintext channel (``_init_channel_attrs`` only
    resets attributes), so this client owns ``connect``: the same steps — channel,
    authentication, stubs, watcher — on a channel ``_open_channel`` makes, secure or not.

    Tokens: aetcd authenticates once, at connect, and sends that token for ever; etcd forgets
    its tokens when it restarts (and after their TTL), and from then on every call of a
    long-running service would fail UNAUTHENTICATED. The token lives in one list that every
    call and the watcher read (``self.metadata`` goes to each stub call, and the same object to
    the watcher), so a renewal swaps it in place for all of them. Renewing on a timer rather
    than on the first refusal keeps aetcd's call code untouched; an etcd restart costs at most
    one interval of refused calls, which the services' retries ride out like an outage."""

    _is_connecting: bool  # aetcd's, untyped there

    def __init__(self, *args: Any, token_renew_s: float = 30.0,
                 channel_credentials: grpc.ChannelCredentials | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._token_renew_s = token_renew_s
        self._channel_credentials = channel_credentials
        self._renewer: asyncio.Task | None = None

    def _open_channel(self) -> grpc.aio.Channel:
        # Its own subchannels: grpc shares a process's subchannels to one address across
        # channels, so a client made just after etcd came back inherited another client's
        # reconnect backoff, grown during the outage, and failed at once with the outage's
        # "connection refused" although etcd answered (seen right after etcd restarts).
        target = f"{self._host}:{self._port}"
        options = [*self._options.items(), ("grpc.use_local_subchannel_pool", 1)]
        if self._channel_credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self._channel_credentials, options=options)

    # aetcd's error mapping, as on its own connect: a refused user is InvalidArgumentError.
    @aetcd.client._handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it, as aetcd does
            if not await wait_event(self._connected, self._connect_wait_timeout):
                raise asyncio.TimeoutError
            return
        self._is_connecting = True
        try:
            self.channel = self._open_channel()
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(self._auth_request(),
                                                          timeout=self._timeout)
                self.metadata = [("token", reply.token)]  # one mutable token (class doc)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False
        if self._renewer is None and self.metadata is not None:
            self._renewer = asyncio.create_task(self._renew(), name="etcd auth token")

    def _auth_request(self) -> aetcd.rpc.AuthenticateRequest:
        return aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)

    async def _renew(self) -> None:
        request = self._auth_request()
        while True:
            await asyncio.sleep(self._token_renew_s)
            try:
                reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
            except Exception as exc:  # etcd down: the next round tries again
                log.debug("etcd auth token renewal failed: %r", exc)
                continue
            if isinstance(self.metadata, list):
                self.metadata[:] = [("token", reply.token)]

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        await super().close()


async def connect(endpoint: str, timeout: float = 5.0) -> aetcd.Client:
    """A connected client, over TLS with this process's certificate for an ``https://``
    endpoint (``check_endpoint``); fails with a clear error when etcd does not answer within
    timeout, refuses the handshake, or refuses this process's credentials."""
    target = check_endpoint(endpoint)
    username, password = _credentials or (None, None)
    client = AuthenticatingClient(
        host=target.host, port=target.port, timeout=timeout, username=username,
        password=password, token_renew_s=_token_renew_s,
        channel_credentials=tls.channel_credentials() if target.tls else None)
    try:
        await asyncio.wait_for(client.status(), timeout)
    except Exception as exc:
        await client.close()
        if username and isinstance(exc, aetcd.exceptions.InvalidArgumentError):
            # Not an outage (etcd_outage.etcd_away): waiting would not change the answer.
            raise ConfigError(f"etcd at {endpoint} refused user {username!r}: {exc}; check "
                              "etcd_username and etcd_password") from exc
        hint = ("; over TLS, etcd's certificate must be signed by tls_ca and tls_cert by a CA "
                "etcd trusts" if target.tls else "")
        raise ConnectionError(f"etcd at {endpoint} did not answer: {exc!r}{hint}") from exc
    return client


@dataclass(frozen=True)
class MemberEvent:
    kind: str  # "join" | "update" | "leave"
    service: str
    member_id: str
    info: dict[str, Any]  # empty on leave


def _renew_period(ttl: float) -> float:
    return max(ttl / 3, 0.2)


async def keep_lease(lease: aetcd.Lease, ttl: float, what: str) -> None:
    """Refresh ``lease`` every ttl/3 while it lives; returns once it lapsed (etcd answers the
    keepalive of a lease it no longer has with TTL 0, not an error: the lease and every key on
    it are gone), for the caller to put them back or say what that means. A refresh that fails
    (etcd unreachable) is tried again, the outage logged once (etcd_outage.py). The one
    keepalive loop of the project."""
    while True:
        await asyncio.sleep(_renew_period(ttl))
        try:
            reply = await lease.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # etcd briefly unreachable: keep trying until the TTL runs out
            etcd_failed(exc, f"renewing the lease of {what}")
            continue
        etcd_answered()
        if reply.TTL <= 0:
            return


class Membership:
    """A registered member: its key lives as long as keepalives renew the lease.

    A lease that lapses anyway (etcd unreachable, or this process's event loop stalled, for
    longer than the TTL) takes the key with it. With ``reregister`` (members) the record is put
    again, on a new lease, at the next renewal or ``update``: a healthy member must not stay
    gone for good. ``lease`` is then the new lease: read it each time, not once. Other keys
    attached to the lapsed lease are gone with it; their writers put them again on ``lease``.
    Without ``reregister`` (an election key, which fences its holder) a lapsed key stays gone.
    ``on_registered_again``: callbacks run after each re-registration, for the writers of
    those other keys."""

    def __init__(self, client: aetcd.Client, key: str, lease: aetcd.Lease, info: dict[str, Any],
                 *, reregister: bool = True):
        self._client = client
        self.key = key
        self.lease = lease
        self.info = dict(info)
        self._ttl = lease.ttl
        self._reregister = reregister
        self._closed = False
        # One write at a time: updates (an older record landing last would undo a newer
        # change), and the switch to a new lease (two tasks must not both grant one).
        self._writing = asyncio.Lock()
        self.on_registered_again: list[Callable[[], Awaitable[None]]] = []
        self._keepalive = asyncio.create_task(self._renew(), name=f"keepalive {key}")

    async def _renew(self) -> None:
        while True:
            lease = self.lease
            await keep_lease(lease, self._ttl, self.key)
            if not self._reregister:
                log.warning("lease of %s lapsed (not renewed within its %d s TTL); its key is "
                            "gone and, as an election key, is not put again", self.key,
                            self._ttl)
                return
            while self.lease is lease:  # else an update already registered again
                try:
                    async with self._writing:
                        if self.lease is lease:
                            await self._register_again(lease)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # etcd unreachable again: try again a period later
                    log.warning("could not register %s again: %r", self.key, exc)
                    await asyncio.sleep(_renew_period(self._ttl))

    async def _register_again(self, lapsed: aetcd.Lease) -> None:
        """Put the record on a new lease; the caller holds ``_writing``."""
        log.warning("lease %x of %s lapsed (not renewed within its %d s TTL: etcd unreachable "
                    "or the event loop stalled), so its key was deleted; registering again on a "
                    "new lease", lapsed.id, self.key, self._ttl)
        lease = await self._client.lease(self._ttl)
        try:
            await self._client.put(self.key.encode(), json.dumps(self.info).encode(), lease=lease)
        except BaseException:  # the key is not on it: do not leave a lease nobody renews
            with contextlib.suppress(Exception):
                await lease.revoke()
            raise
        self.lease = lease
        for callback in self.on_registered_again:
            try:
                await callback()
            except Exception as exc:  # theirs to log: the member itself is back
                log.warning("after registering %s again: %r", self.key, exc)

    async def update(self, **changes: Any) -> None:
        """Change fields of the record. Concurrent updates write one at a time, each the whole
        record as it is then: two puts in flight at once may land in either order, and an older
        record landing last would undo a newer change. A lapsed lease is replaced (class doc)."""
        self.info.update(changes)
        async with self._writing:
            lease = self.lease
            try:
                await self._client.put(self.key.encode(), json.dumps(self.info).encode(),
                                       lease=lease)
            except aetcd.ClientError as exc:
                if not (lease_not_found(exc) and self._reregister and not self._closed):
                    raise
                await self._register_again(lease)

    async def close(self) -> None:
        """Leave at once (revoking the lease deletes the key) instead of waiting for the TTL."""
        self._closed = True
        self._keepalive.cancel()
        await asyncio.wait([self._keepalive])  # a renewal in flight may have swapped the lease
        async with self._writing:  # so may an update
            try:
                await self.lease.revoke()
            except Exception as exc:
                log.warning("could not revoke lease of %s: %r", self.key, exc)


def lease_not_found(exc: Exception) -> bool:
    """A write refused because its lease expired (etcd's NOT_FOUND; aetcd keeps the gRPC error
    as the cause)."""
    cause = exc.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.NOT_FOUND


async def register(client: aetcd.Client, service: str, member_id: str, info: dict[str, Any],
                   ttl: int = 5) -> Membership:
    key = keys.member_key(service, member_id)
    lease = await client.lease(ttl)
    await client.put(key.encode(), json.dumps(info).encode(), lease=lease)
    return Membership(client, key, lease, info)


async def list_members(client: aetcd.Client, service: str | None = None) -> dict[str, dict]:
    """member key -> info for every live member (of one service, or all)."""
    found = await client.get_prefix(keys.members_prefix(service).encode())
    return _members({kv.key.decode(): kv.value for kv in found})


def _member_info(key: str, value: bytes) -> dict | None:
    """A member record's info; None (and a warning) for one that is no JSON object: a record
    some other writer broke must not stop everyone's discovery of every other member."""
    try:
        info = json.loads(value)
    except ValueError:
        info = None
    if not isinstance(info, dict):
        log.warning("ignoring member record %s: not a JSON object (%r)", key, value[:80])
        return None
    return info


def _members(values: dict[str, bytes]) -> dict[str, dict]:
    return {key: info for key, value in values.items()
            if (info := _member_info(key, value)) is not None}


@dataclass(frozen=True)
class Listing:
    """Every key in the watched range with its value, read at ``revision``: the first thing a
    watch yields, and again after every break (what changed meanwhile is folded into it)."""

    values: dict[str, bytes]
    revision: int


@dataclass(frozen=True)
class Change:
    """One change after the last Listing, in revision order; ``value`` None: deleted."""

    key: str
    value: bytes | None
    revision: int


async def list_and_watch(client: aetcd.Client, key: str, *, prefix: bool = True,
                         retry_delay: float = 0.5) -> AsyncIterator[Listing | Change]:
    """The keys starting with ``key`` (``prefix`` False: the key alone), for ever, without gaps:
    a ``Listing`` of them, then every ``Change`` from the next revision on. When the watch
    breaks (etcd restarted, revision compacted, connection lost) it lists again after
    ``retry_delay`` and goes on from there, so a consumer that applies each Listing as the
    whole truth converges on etcd's state. Only cancellation ends it."""
    start = key.encode()
    end = prefix_range_end(start) if prefix else start + b"\0"
    while True:
        try:
            found = await client.get_range(start, end)
            yield Listing({kv.key.decode(): kv.value for kv in found}, found.header.revision)
            watch = await client.watch(start, range_end=end,
                                       start_revision=found.header.revision + 1)
            try:
                async for ev in watch:
                    deleted = ev.kind == aetcd.EventKind.DELETE
                    yield Change(ev.kv.key.decode(), None if deleted else ev.kv.value,
                                 ev.kv.mod_revision)
            finally:
                await watch.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("watch of %s broke (%r); listing again in %.1fs", key, exc, retry_delay)
            await asyncio.sleep(retry_delay)


async def watch_members(client: aetcd.Client, service: str | None = None,
                        retry_delay: float = 0.5) -> AsyncIterator[MemberEvent]:
    """Current members as ``join`` events, then every change, without gaps; after a broken
    watch, the difference to what was reported (``list_and_watch``)."""
    known: dict[str, dict] = {}
    async for item in list_and_watch(client, keys.members_prefix(service),
                                     retry_delay=retry_delay):
        if isinstance(item, Listing):
            current = _members(item.values)
            for event in _diff(known, current):
                yield event
            known = current
        elif (change := _to_event(item, known)) is not None:
            yield change


async def wake_on_change(client: aetcd.Client, key: str, wake: asyncio.Event, *,
                         prefix: bool = False, retry_delay: float = 1.0) -> None:
    """Set ``wake`` on every change under ``key`` (or every key starting with it), for ever;
    also after a broken watch is back (changes may have been missed meanwhile). For loops that
    re-read etcd when woken."""
    async for _ in list_and_watch(client, key, prefix=prefix, retry_delay=retry_delay):
        wake.set()


def _diff(old: dict[str, dict], new: dict[str, dict]) -> list[MemberEvent]:
    events = []
    for key in old.keys() - new.keys():
        events.append(MemberEvent("leave", *keys.parse_member_key(key), {}))
    for key, info in new.items():
        if key not in old:
            events.append(MemberEvent("join", *keys.parse_member_key(key), info))
        elif old[key] != info:
            events.append(MemberEvent("update", *keys.parse_member_key(key), info))
    return events


def _to_event(change: Change, known: dict[str, dict]) -> MemberEvent | None:
    service, member_id = keys.parse_member_key(change.key)
    if change.value is None:
        if known.pop(change.key, None) is None:
            return None
        return MemberEvent("leave", service, member_id, {})
    info = _member_info(change.key, change.value)
    if info is None:  # unreadable: as if it were gone
        return MemberEvent("leave", service, member_id, {}) \
            if known.pop(change.key, None) is not None else None
    kind = "update" if change.key in known else "join"
    known[change.key] = info
    return MemberEvent(kind, service, member_id, info)


class _KeyVanished(Exception):
    """A candidate's election key is gone: its lease expired."""


class Election:
    """Leader election (etcd's recipe): each candidate writes a key under the election prefix with
    its lease; the oldest key (lowest create revision) leads. A candidate waits on the deletion of
    the key just ahead of it, so a crash hands over within the lease TTL and nobody herds."""

    def __init__(self, client: aetcd.Client, name: str, candidate: str, ttl: int = 5):
        self._client = client
        self._prefix = keys.election_prefix(name)
        self._candidate = candidate
        self._ttl = ttl
        self._membership: Membership | None = None

    @property
    def key(self) -> str | None:
        return self._membership.key if self._membership else None

    async def campaign(self) -> None:
        """Returns once this candidate leads. Cancel it to stop campaigning. etcd away (a
        restart, an outage) is waited out; a key whose lease lapsed meanwhile is put again on a
        new lease, at the back of the line."""
        while True:
            if self._membership is None:
                await with_etcd(self._enter, "entering the election")
            assert self._membership is not None
            key = self._membership.key
            try:
                ahead = await with_etcd(partial(self._key_ahead, key), "reading the election")
            except _KeyVanished:
                log.warning("election key %s lapsed (etcd was away longer than its lease); "
                            "campaigning again", key)
                await self.resign()
                continue
            if ahead is None:
                return
            try:
                await self._client.watch_once(ahead.encode(), kind=aetcd.EventKind.DELETE,
                                              timeout=self._ttl)
            except aetcd.WatchTimeoutError:
                pass  # re-check: the key may have gone before the watch started
            except Exception as exc:
                if not etcd_away(exc):
                    raise
                etcd_failed(exc, "watching the election")  # re-check once etcd answers

    async def _enter(self) -> None:
        lease = await self._client.lease(self._ttl)
        key = f"{self._prefix}{lease.id:x}"
        await self._client.put(key.encode(), self._candidate.encode(), lease=lease)
        self._membership = Membership(self._client, key, lease, {"candidate": self._candidate},
                                      reregister=False)  # a lapsed key fences its holder out

    async def _key_ahead(self, mine: str) -> str | None:
        found = await self._client.get_prefix(self._prefix.encode(), sort_target="create",
                                              sort_order="ascend")
        ordered = [kv.key.decode() for kv in found]
        if mine not in ordered:
            raise _KeyVanished(mine)
        index = ordered.index(mine)
        return ordered[index - 1] if index > 0 else None

    async def leader(self) -> str | None:
        found = await self._client.get_prefix(self._prefix.encode(), sort_target="create",
                                              sort_order="ascend")
        for kv in found:
            return kv.value.decode()
        return None

    async def resign(self) -> None:
        if self._membership is not None:
            await self._membership.close()
            self._membership = None


class StaleVersionError(ValueError):
    """A versioned record may only move forward."""


async def get_versioned(client: aetcd.Client, key: str) -> dict | None:
    found = await client.get(key.encode())
    return json.loads(found.value) if found is not None else None


async def put_versioned(client: aetcd.Client, key: str, version: int, record: dict[str, Any],
                        attempts: int = 20) -> None:
    """Write ``record`` with ``version`` if it is newer than the stored one (compare-and-swap on the
    key's mod revision, retried under contention). Raises StaleVersionError otherwise."""
    value = json.dumps({**record, "version": version}).encode()
    for _ in range(attempts):
        found = await client.get(key.encode())
        tx = client.transactions
        if found is None:
            compare = [tx.version(key.encode()) == 0]
        else:
            stored = json.loads(found.value)["version"]
            if stored >= version:
                raise StaleVersionError(f"{key}: version {version} is not newer than {stored}")
            compare = [tx.mod(key.encode()) == found.mod_revision]
        ok, _ = await client.transaction(compare=compare, success=[tx.put(key.encode(), value)],
                                            failure=[])
        if ok:
            return
    raise RuntimeError(f"{key}: gave up after {attempts} contended attempts")


def parse_instance_cap(raw: bytes | None) -> int | None:
    """{"n_prem": n} -> n; absent -> None. A malformed record is logged and read as no cap: a
    bad write must not stop the job's rollout."""
    if raw is None:
        return None
    try:
        cap = json.loads(raw)["n_prem"]
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
            return cap
    except (ValueError, KeyError, TypeError):
        pass
    log.error("ignoring a malformed instance cap %r: expected {\"n_prem\": <int >= 0>}", raw[:200])
    return None


def instance_cap_record(n_prem: int) -> bytes:
    """What ``keys.instance_cap_key`` holds: the one writer-side form ``parse_instance_cap``
    reads."""
    return json.dumps({"n_prem": n_prem}).encode()


async def read_instance_cap(client: aetcd.Client, job: str) -> int | None:
    """The job's N_prem now (None: no cap, or a malformed record)."""
    found = await client.get(keys.instance_cap_key(job).encode())
    return parse_instance_cap(None if found is None else found.value)

"""Ports the tests and the local stack hand to services (``local_etcd.free_ports``): distinct,
bindable, below the kernel's ephemeral range (an outgoing connection's source port cannot take
one before the service binds it) and never handed out twice by one process."""

from __future__ import annotations

import socket

from rlharvest.common import local_etcd


def test_ports_are_distinct_bindable_below_the_ephemeral_range_and_never_repeated(monkeypatch):
    floor = 40_000  # a kernel's ephemeral range starting here (Linux's default: 32768)
    monkeypatch.setattr(local_etcd, "_ephemeral_floor", lambda: floor)
    seen: set[int] = set()
    for _ in range(50):
        ports = local_etcd.free_ports(4)
        assert len(set(ports)) == 4 and not seen & set(ports)
        seen.update(ports)
        assert all(10_000 <= p < floor for p in ports), ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", local_etcd.free_port()))  # free indeed


def test_a_port_taken_meanwhile_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        picks = iter([busy, busy + 1 if busy < 65_000 else busy - 1])
        monkeypatch.setattr(local_etcd.random.Random, "randint", lambda self, a, b: next(picks))
        monkeypatch.setattr(local_etcd, "_ephemeral_floor", lambda: 65_535)
        monkeypatch.setattr(local_etcd, "_handed_out", set())
        assert local_etcd.free_ports(1) != [busy]

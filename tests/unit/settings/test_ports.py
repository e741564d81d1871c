"""``free_port`` (settings/ports.py) never hands out a port of the ephemeral range, where
outgoing connections take their source ports, and what it hands out can be bound."""

from __future__ import annotations

import socket

import pytest

from settings.ports import FIRST_PICKED, ephemeral_range, free_port, free_ports

pytestmark = pytest.mark.unit


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    low, high = ephemeral_range()
    assert FIRST_PICKED < low <= high
    for _ in range(20):
        port = free_port()
        assert FIRST_PICKED <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr("settings.ports.ephemeral_range", lambda: (busy + 2, 60999))
        monkeypatch.setattr("settings.ports.FIRST_PICKED", busy)
        for _ in range(10):  # candidates busy and busy + 1: the busy one is never returned
            assert free_port() != busy


def test_ports_picked_together_are_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports picked for services that have not bound them yet never repeat: with two
    free candidates and a third excluded, the two are handed out, the excluded one never
    (were a candidate taken meanwhile, the kernel's pick stands in for it)."""
    base = free_port()
    monkeypatch.setattr("settings.ports.ephemeral_range", lambda: (base + 3, 60999))
    monkeypatch.setattr("settings.ports.FIRST_PICKED", base)
    for _ in range(10):
        ports = free_ports(2, exclude=[base + 2])
        assert len(set(ports)) == 2 and base + 2 not in ports

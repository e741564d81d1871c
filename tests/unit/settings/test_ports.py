"""``free_port`` (settings/ports.py) never hands out a port of the ephemeral range, where
outgoing connections take their source ports, and what it hands out can be bound."""

from __future__ import annotations

import socket

import pytest

from settings.ports import FIRST_PICKED, ephemeral_range, free_port

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

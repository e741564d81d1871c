"""The one set of default ports every service and client agrees on, and ``free_port``.

``launch/run_all.sh`` picks free ports for its own run and hands every service the URLs of
the others (docs/RECIPES.md); these defaults are what a service started by hand listens on
and what its clients look for. The API's matches Atropos' ``run-api`` (8000), the inference
server's the Atropos example trainer's (9001), so an Atropos trainer or environment finds them.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from contextlib import ExitStack
from pathlib import Path

HOST = "127.0.0.1"
API_PORT = 8000
"""The batching API (``python -m api``); Atropos' ``run-api`` default."""
VLLM_PORT = 9001
"""The patched vLLM server (``python -m vllm_patching.serve``; vLLM's own default would be
8000, the API's: the wrapper passes ``--port 9001`` unless told otherwise)."""
API_URL = f"http://{HOST}:{API_PORT}"
VLLM_URL = f"http://{HOST}:{VLLM_PORT}"
FIRST_PICKED = 15000
"""``free_port`` draws from ``[FIRST_PICKED, start of the ephemeral range)``: above the
well-known defaults (8000, 9001), below the ports outgoing connections use."""


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out as the source ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = HOST, exclude: Collection[int] = ()) -> int:
    """A TCP port on ``host`` that is free now, that no outgoing connection will take, and
    that is not one of ``exclude``.

    A port the kernel picks for ``bind(host, 0)`` lies in the ephemeral range, where every
    outgoing connection of the machine (an HTTP client, a test's many) also draws its source
    port: between this call and the service's own bind one of them can take it ("address
    already in use", seen in a launcher test). So the port is drawn at random below that
    range and checked by binding it; only if none of 64 tries is free does the kernel pick.
    Several services that start later: :func:`free_ports`."""
    return free_ports(1, host, exclude)[0]


def free_ports(n: int, host: str = HOST, exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct ports (:func:`free_port`) for services that have not started yet.

    A port only becomes taken when its service binds it, so separate draws can land on the
    same free port (a launcher's API and vLLM once did). Each port picked here stays bound
    until all ``n`` are picked, so neither a draw nor the kernel can hand it out twice."""
    low, _ = ephemeral_range()
    top = max(FIRST_PICKED + 1, low)
    rng = random.SystemRandom()
    with ExitStack() as held:
        ports: list[int] = []
        while len(ports) < n:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(64):
                port = rng.randrange(FIRST_PICKED, top)
                if port in exclude:
                    continue
                try:
                    s.bind((host, port))
                    break
                except OSError:
                    continue
            else:
                s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in exclude:  # the kernel's pick may be one
                ports.append(port)
        return ports

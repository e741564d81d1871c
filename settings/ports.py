"""The one set of default ports every service and client agrees on, and ``free_port``.

``launch/run_all.sh`` picks free ports for its own run and hands every service the URLs of
the others (docs/RECIPES.md); these defaults are what a service started by hand listens on
and what its clients look for. The API's matches Atropos' ``run-api`` (8000), the inference
server's the Atropos example trainer's (9001), so an Atropos trainer or environment finds them.
"""

from __future__ import annotations

import random
import socket
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


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that is free now and that no outgoing connection will take.

    A port the kernel picks for ``bind(host, 0)`` lies in the ephemeral range, where every
    outgoing connection of the machine (an HTTP client, a test's many) also draws its source
    port: between this call and the service's own bind one of them can take it ("address
    already in use", seen in a launcher test). So the port is drawn at random below that
    range and checked by binding it; only if none of 64 tries is free does the kernel pick."""
    low, _ = ephemeral_range()
    top = max(FIRST_PICKED + 1, low)
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(FIRST_PICKED, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

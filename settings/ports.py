"""The one set of default ports every service and client agrees on, and ``free_port``.

``launch/run_all.sh`` picks free ports for its own run and hands every service the URLs of
the others (docs/RECIPES.md); these defaults are what a service started by hand listens on
and what its clients look for. The API's matches Atropos' ``run-api`` (8000), the inference
server's the Atropos example trainer's (9001), so an Atropos trainer or environment finds them.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
API_PORT = 8000
"""The batching API (``python -m api``); Atropos' ``run-api`` default."""
VLLM_PORT = 9001
"""The patched vLLM server (``python -m vllm_patching.serve``; vLLM's own default would be
8000, the API's: the wrapper passes ``--port 9001`` unless told otherwise)."""
API_URL = f"http://{HOST}:{API_PORT}"
VLLM_URL = f"http://{HOST}:{VLLM_PORT}"


def free_port(host: str = HOST) -> int:
    """Ask the kernel for a free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

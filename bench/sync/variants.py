"""The two bridge variants ``bench/sync/bridge_sync.py`` measures only for comparison; the
trainer never uses them, so they live here, not in trainer/bridge/:

- ``PackingCopyBridge``: the broadcast without resident weights -- every sync packs (copies)
  the weights into the send buffer (what ``StagedBridge`` did before ``ResidentWeights``).
- ``RestartBridge``: Atropos' legacy ``none`` mode -- every sync saves a checkpoint and
  restarts the one server this bridge was given from it (stopped and started by PID, same
  port); the stall is the whole restart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.bridge import WeightBridge, make_bridge
from trainer.bridge.gloo_broadcast import GlooBroadcastBridge
from trainer.bridge.reload import CheckpointReloadBridge
from trainer.bridge.resident import ResidentWeights
from vllm_patching.transport import Packer


class PackingCopyBridge(GlooBroadcastBridge):
    """The broadcast, copying the weights into the send buffer at every sync."""

    def _adopt(self, packer: Packer, params: list[torch.nn.Parameter]) -> ResidentWeights | None:
        return None


class RestartBridge(CheckpointReloadBridge):
    """``none`` by restarting the server: ``server`` is anything with
    ``restart(model, initial_version) -> server`` (``launch.vllm_server.BridgeServer``);
    ``self.server`` is the running one after every sync."""

    def __init__(
        self, server_urls: Sequence[str], save_dir: str | Path, server: Any, **kw: Any
    ) -> None:
        if len(server_urls) != 1:
            raise ValueError("a restart needs the one server this bridge started")
        super().__init__(server_urls, save_dir, **kw)
        self.server = server

    def _apply(self, path: Path, version: int) -> list[dict]:
        t0 = time.perf_counter()
        # Same port, so the server's clients (and self.servers[0]) keep their URL.
        self.server = self.server.restart(path, initial_version=version)
        stall = time.perf_counter() - t0
        return [{"weight_version": str(version), "stall_s": stall, "restarted": True}]


def bench_bridge(mode: str, url: str, token: str, kw: dict[str, Any]) -> WeightBridge:
    """The bridge of one benchmark mode: ``make_bridge`` kwargs, plus the bench-only flags
    ``resident=False`` (``PackingCopyBridge``) and ``restart=True`` (``RestartBridge``)."""
    kw = dict(kw)
    if kw.pop("restart", False):
        return RestartBridge([url], token=token, **kw)
    if not kw.pop("resident", True):
        if mode != "shared_vllm":
            raise ValueError("resident=False is a variant of the broadcast (shared_vllm)")
        return PackingCopyBridge([url], token=token, **kw)
    return make_bridge(mode, [url], token=token, **kw)

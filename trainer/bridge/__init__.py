"""Trainer side of the weight bridge: ``make_bridge(mode, server_urls, ...)`` -> ``WeightBridge``.

| mode | CPU | CUDA |
|---|---|---|
| shared_vllm | ``GlooBroadcastBridge`` (gloo) | ``NativeCudaBridge`` (vLLM ``nccl``) |
| shared_vllm + single_copy | ``SharedMemoryBridge`` (/dev/shm) | ``NativeCudaBridge`` (vLLM ``ipc``) |
| lora_only | ``LoraBridge`` (peft adapter per version) | same |
| none | ``CheckpointReloadBridge`` (safetensors + in-place reload) | same |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer.bridge.base import SyncStats, WeightBridge

__all__ = ["WeightBridge", "SyncStats", "make_bridge"]


def make_bridge(
    mode: str,
    server_urls: Sequence[str],
    *,
    single_copy: bool = False,
    token: str | None = None,
    device: str = "cpu",
    save_dir: str | None = None,
    restart_interval: int = 1,
    **kwargs: Any,
) -> WeightBridge:
    """Build the bridge client for ``mode`` (``shared_vllm``, ``lora_only``, ``none``).

    ``device`` is where the *servers'* workers run (``cpu`` or ``cuda``); ``save_dir`` is where
    lora_only/none write adapters/checkpoints; ``restart_interval`` (mode none) applies the
    weights every N-th sync. ``kwargs`` go to the mode's class (e.g. ``bucket_bytes`` for the
    broadcast, ``restart=True, server=...`` for none's restart-the-server variant).
    """
    if single_copy and mode != "shared_vllm":
        raise ValueError("single_copy only applies to mode shared_vllm")
    if restart_interval != 1 and mode != "none":
        raise ValueError("restart_interval only applies to mode none")
    if mode in ("lora_only", "none") and save_dir is None:
        raise ValueError(f"mode {mode} needs save_dir (adapters/checkpoints are written there)")
    if mode == "shared_vllm":
        if device == "cuda":
            from trainer.bridge.cuda import NativeCudaBridge

            return NativeCudaBridge(server_urls, token=token, single_copy=single_copy, **kwargs)
        from trainer.bridge.shared_vllm import GlooBroadcastBridge, SharedMemoryBridge

        if single_copy:
            return SharedMemoryBridge(server_urls, token=token, **kwargs)
        return GlooBroadcastBridge(server_urls, token=token, **kwargs)
    if mode == "lora_only":
        from trainer.bridge.lora import LoraBridge

        return LoraBridge(server_urls, save_dir=save_dir, token=token, **kwargs)
    if mode == "none":
        from trainer.bridge.reload import CheckpointReloadBridge

        return CheckpointReloadBridge(
            server_urls, save_dir=save_dir, token=token, reload_every=restart_interval, **kwargs
        )
    raise ValueError(f"unknown bridge mode {mode!r} (shared_vllm, lora_only, none)")

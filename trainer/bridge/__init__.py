"""Trainer side of the weight bridge: ``make_bridge(mode, server_urls, ...)`` -> ``WeightBridge``.

| mode | CPU | CUDA |
|---|---|---|
| shared_vllm | ``GlooBroadcastBridge`` (gloo) | ``NativeCudaBridge`` (vLLM ``nccl``) |
| shared_vllm + single_copy | ``SharedMemoryBridge`` (/dev/shm) | ``NativeCudaBridge`` (vLLM ``ipc``) |
| lora_only | ``LoraBridge`` (peft adapter per version) | same |
| none | ``CheckpointReloadBridge`` (safetensors + in-place reload) | same |
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.bridge.base import SyncStats, WeightBridge

__all__ = ["WeightBridge", "SyncStats", "make_bridge", "rendezvous_from_env"]


def rendezvous_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``MASTER_ADDR`` / ``MASTER_PORT`` (Atropos' names) -> the broadcast group's rendezvous.

    The trainer is rank 0 and hosts the rendezvous, so ``MASTER_ADDR`` is an address of the
    trainer's machine that every inference worker can reach (default 127.0.0.1), and
    ``MASTER_PORT`` a free port there (default: a free one is picked at the first sync).
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if env.get("MASTER_ADDR"):
        out["master_address"] = env["MASTER_ADDR"]
    if env.get("MASTER_PORT"):
        try:
            out["master_port"] = int(env["MASTER_PORT"])
        except ValueError:
            raise ValueError(
                f"MASTER_PORT must be a port number, got {env['MASTER_PORT']!r}"
            ) from None
    return out


def make_bridge(
    mode: str,
    server_urls: Sequence[str],
    *,
    single_copy: bool = False,
    token: str | None = None,
    device: str = "cpu",
    save_dir: str | None = None,
    reload_every: int = 1,
    trainer_device: str | None = None,
    **kwargs: Any,
) -> WeightBridge:
    """Build the bridge client for ``mode`` (``shared_vllm``, ``lora_only``, ``none``).

    ``device`` is where the *servers'* workers run (``cpu`` or ``cuda``); ``save_dir`` is where
    lora_only/none write adapters/checkpoints; ``reload_every`` (mode none) applies the
    weights every N-th sync. ``trainer_device`` (CUDA only) is the trainer's own GPU, made
    current before the native engine is built (NCCL joins from it, IPC keys its handles by
    it). ``kwargs`` go to the mode's class (e.g. ``bucket_bytes`` for the
    broadcast; ``deadlines``, a ``trainer.config.SyncDeadlines``, for every mode: how long
    each phase of a sync may wait on a server, trainer/bridge/deadline.py). The
    broadcast's rendezvous comes from ``MASTER_ADDR``/``MASTER_PORT`` when they are set
    (``rendezvous_from_env``) unless ``kwargs`` name it.
    """
    if single_copy and mode != "shared_vllm":
        raise ValueError("single_copy only applies to mode shared_vllm")
    if reload_every != 1 and mode != "none":
        raise ValueError("reload_every only applies to mode none")
    if mode in ("lora_only", "none") and save_dir is None:
        raise ValueError(f"mode {mode} needs save_dir (adapters/checkpoints are written there)")
    if mode == "shared_vllm":
        if not single_copy:  # a broadcast: its rendezvous may be pinned, as in Atropos
            kwargs = {**rendezvous_from_env(), **kwargs}
        if device == "cuda":
            from trainer.bridge.cuda import NativeCudaBridge

            return NativeCudaBridge(
                server_urls,
                token=token,
                single_copy=single_copy,
                trainer_device=trainer_device,
                **kwargs,
            )
        if single_copy:
            from trainer.bridge.shared_memory import SharedMemoryBridge

            return SharedMemoryBridge(server_urls, token=token, **kwargs)
        from trainer.bridge.gloo_broadcast import GlooBroadcastBridge

        return GlooBroadcastBridge(server_urls, token=token, **kwargs)
    if mode == "lora_only":
        from trainer.bridge.lora import LoraBridge

        return LoraBridge(server_urls, save_dir=save_dir, token=token, **kwargs)
    if mode == "none":
        from trainer.bridge.reload import CheckpointReloadBridge

        return CheckpointReloadBridge(
            server_urls, save_dir=save_dir, token=token, reload_every=reload_every, **kwargs
        )
    raise ValueError(f"unknown bridge mode {mode!r} (shared_vllm, lora_only, none)")

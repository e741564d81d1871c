"""Trainer side of the weight bridge: ``bridge_for(cfg.weights, server_urls, ...)`` ->
``WeightBridge``, the class of the config's transport (``trainer.grpo.weights``,
trainer/weights_config.py) from :data:`TRANSPORTS`:

| ``weights.type`` (old mode) | CPU | CUDA |
|---|---|---|
| broadcast (shared_vllm) | ``GlooBroadcastBridge`` (gloo) | ``NativeCudaBridge`` (vLLM ``nccl``) |
| single_copy (shared_vllm + single_copy) | ``SharedMemoryBridge`` (/dev/shm) | ``NativeCudaBridge`` (vLLM ``ipc``) |
| lora (lora_only) | ``LoraBridge`` (peft adapter per version) | same |
| reload (none) | ``CheckpointReloadBridge`` (safetensors + in-place reload) | same |

``make_bridge(mode, server_urls, single_copy=..., reload_every=...)`` is the same with the old
spelling (benchmarks, tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args

from trainer.bridge.base import SyncStats, WeightBridge
from trainer.weights_config import (
    BY_TYPE,
    BroadcastWeights,
    LoraWeights,
    ReloadWeights,
    SingleCopyWeights,
    WeightTransport,
    old_pair_tag,
)
from vllm_patching.protocol import BridgeMode

__all__ = ["WeightBridge", "SyncStats", "bridge_for", "make_bridge", "rendezvous_from_env"]


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


def _broadcast(
    weights: BroadcastWeights, urls: Sequence[str], device: str, **kwargs: Any
) -> WeightBridge:
    kwargs = {**rendezvous_from_env(), **kwargs}  # its rendezvous may be pinned, as in Atropos
    if device == "cuda":
        from trainer.bridge.cuda import NativeCudaBridge

        return NativeCudaBridge(urls, single_copy=False, **kwargs)
    from trainer.bridge.gloo_broadcast import GlooBroadcastBridge

    kwargs.pop("trainer_device", None)
    return GlooBroadcastBridge(urls, **kwargs)


def _single_copy(
    weights: SingleCopyWeights, urls: Sequence[str], device: str, **kwargs: Any
) -> WeightBridge:
    if device == "cuda":
        from trainer.bridge.cuda import NativeCudaBridge

        return NativeCudaBridge(urls, single_copy=True, **kwargs)
    from trainer.bridge.shared_memory import SharedMemoryBridge

    kwargs.pop("trainer_device", None)
    return SharedMemoryBridge(urls, **kwargs)


def _lora(weights: LoraWeights, urls: Sequence[str], device: str, **kwargs: Any) -> WeightBridge:
    from trainer.bridge.lora import LoraBridge

    kwargs.pop("trainer_device", None)
    return LoraBridge(urls, **kwargs)


def _reload(
    weights: ReloadWeights, urls: Sequence[str], device: str, **kwargs: Any
) -> WeightBridge:
    from trainer.bridge.reload import CheckpointReloadBridge

    kwargs.pop("trainer_device", None)
    return CheckpointReloadBridge(urls, reload_every=weights.reload_every, **kwargs)


TRANSPORTS: dict[str, Callable[..., WeightBridge]] = {
    "broadcast": _broadcast,
    "single_copy": _single_copy,
    "lora": _lora,
    "reload": _reload,
}
"""``weights.type`` -> what builds its bridge class (for the servers' ``device``)."""


def bridge_for(
    weights: WeightTransport,
    server_urls: Sequence[str],
    *,
    save_dir: str,
    token: str | None = None,
    device: str = "cpu",
    trainer_device: str | None = None,
    **kwargs: Any,
) -> WeightBridge:
    """The bridge client of the transport ``weights`` (``GrpoConfig.weights``).

    ``device`` is where the *servers'* workers run (``cpu`` or ``cuda``); ``save_dir`` is where
    ``lora``/``reload`` write adapters/checkpoints. ``trainer_device`` (CUDA only) is the
    trainer's own GPU, made current before the native engine is built (NCCL joins from it,
    IPC keys its handles by it). ``kwargs`` go to the transport's class (e.g.
    ``bucket_bytes`` for the broadcast; ``deadlines``, a ``trainer.config.SyncDeadlines``,
    for every transport: how long each phase of a sync may wait on a server,
    trainer/bridge/deadline.py). The broadcast's rendezvous comes from
    ``MASTER_ADDR``/``MASTER_PORT`` when they are set (``rendezvous_from_env``) unless
    ``kwargs`` name it.
    """
    if weights.type in ("lora", "reload"):
        kwargs["save_dir"] = save_dir
    if device == "cuda":
        kwargs["trainer_device"] = trainer_device
    return TRANSPORTS[weights.type](weights, server_urls, device, token=token, **kwargs)


def make_bridge(
    mode: str,
    server_urls: Sequence[str],
    *,
    single_copy: bool = False,
    save_dir: str | None = None,
    reload_every: int = 1,
    **kwargs: Any,
) -> WeightBridge:
    """:func:`bridge_for` in the old spelling: ``mode`` (``shared_vllm``, ``lora_only``,
    ``none``) with ``single_copy`` and ``reload_every`` (mode none: apply every N-th sync).
    A combination no transport has is refused (``ValueError``, naming the key)."""
    if mode not in (modes := get_args(BridgeMode)):
        raise ValueError(f"unknown bridge mode {mode!r} ({', '.join(modes)})")
    tag = old_pair_tag(mode, single_copy)
    fields = {"reload_every": reload_every} if reload_every != 1 or tag == "reload" else {}
    weights = BY_TYPE[tag].model_validate({"type": tag, **fields})  # refuses reload_every
    if tag in ("lora", "reload") and save_dir is None:
        raise ValueError(f"mode {mode} needs save_dir (adapters/checkpoints are written there)")
    return bridge_for(weights, server_urls, save_dir=save_dir or "", **kwargs)

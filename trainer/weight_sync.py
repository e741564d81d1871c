"""Weight sync that survives inference-server restarts, and the bridge it syncs through.

A weight sync that fails because an inference server is down or restarted is retried until
it is back (``api.retry``, for ``reconnect_timeout`` seconds); a phase that misses its
deadline is not (the trainer stops and names it). While the trainer waits for data it watches
the servers' ``run_id``: a restarted server serves the start weights, so it is re-synced at
once (docs/FAULT_TOLERANCE.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from trainer.config import GrpoConfig

log = logging.getLogger(__name__)


class WeightSync:
    """``bridge.sync`` that survives inference-server restarts (see the module docstring).

    Which run of each server holds our weights is the bridge's record (``bridge.runs``,
    trainer/bridge/runs.py): every bridge keeps it current as it syncs; this class only asks
    it."""

    def __init__(self, bridge: Any, model: Any, cfg: GrpoConfig) -> None:
        self.bridge, self.model, self.cfg = bridge, model, cfg
        self.runs = bridge.runs
        if self.runs.ids is None:  # the servers that hold our weights (now: the start weights)
            try:
                self.runs.record(self.runs.current())
            except Exception:  # noqa: BLE001 - down already: re-synced once back
                pass

    def sync(self, version: int) -> Any:
        """Sync ``version``; a failure while a server is down or restarted is retried (with
        backoff, each retry logged) until it is back, for at most ``reconnect_timeout``."""
        from api.retry import RetryPolicy, retry_call

        before = self.runs.ids

        def attempt() -> Any:
            nonlocal before
            before = self.runs.ids
            return self.bridge.sync(self.model, version)

        policy = RetryPolicy(deadline_s=self.cfg.reconnect_timeout)
        what = f"weight sync of version {version} (is the inference server down or restarted?)"
        return retry_call(attempt, what, lambda e: self._restarted(before, e), policy, logger=log)

    def _restarted(self, before: list[str] | None, error: BaseException) -> bool:
        """Is ``error`` explained by a server being unreachable or restarted since ``before``?
        (Anything else -- a wrong token, a shape mismatch, a server's 500 -- is raised at
        once.) Unreachable: a transport failure that the one transient rule accepts
        (``api.retry.is_transient``; a whole sync is safe to repeat). A phase that missed its
        deadline (``SyncTimeout``: a server that hangs, not one that is down) is never
        retried: the trainer stops and says which phase of which server."""
        import httpx

        from api.retry import is_transient
        from trainer.bridge.deadline import SyncTimeout

        if isinstance(error, SyncTimeout):
            return False
        if isinstance(error, httpx.TransportError) and is_transient(error):
            return True
        try:
            return self.runs.current() != before
        except Exception:  # noqa: BLE001 - unreachable now: down
            return True

    def resync_if_restarted(self, version: int) -> None:
        """A server restarted since our last sync serves the start weights: sync it now."""
        try:
            restarted = self.runs.restarted()
        except Exception as e:  # noqa: BLE001 - down: the next poll or sync sees it come back
            log.warning(
                "inference server unreachable (%s); will re-sync when it is back", type(e).__name__
            )
            return
        if restarted:
            log.warning("inference server restarted (new run_id): re-syncing version %d", version)
            self.sync(version)


def retrying(cfg: GrpoConfig, what: str, fn: Any) -> Any:
    """``fn()`` (idempotent) retried on transient failures (``api.retry.is_transient``) for
    up to ``reconnect_timeout`` seconds."""
    from api.retry import RetryPolicy, is_transient, retry_call

    return retry_call(
        fn, what, is_transient, RetryPolicy(deadline_s=cfg.reconnect_timeout), logger=log
    )


def connect_bridge(cfg: GrpoConfig, trainer_device: str, sharded: bool) -> Any:
    """The bridge of ``cfg.weights`` (trainer.bridge.bridge_for) to every inference server,
    connected with retries (the servers may still be starting)."""
    from trainer.bridge import bridge_for

    return retrying(
        cfg,
        "connect to the inference servers",
        lambda: bridge_for(
            cfg.weights, cfg.inference_urls(), **bridge_kwargs(cfg, trainer_device, sharded)
        ),
    )


def bridge_kwargs(cfg: GrpoConfig, trainer_device: str, sharded: bool = False) -> dict[str, Any]:
    """``trainer_device``: the trainer's torch device (``cpu``, ``cuda:N``)."""
    own = trainer_device.split(":")[0]
    device = own if cfg.inference_device == "auto" else cfg.inference_device
    extra = {"trainer_device": trainer_device} if device == "cuda" else {}
    kwargs: dict[str, Any] = {
        **extra,
        "device": device,
        "token": cfg.bridge_token,
        "save_dir": f"{cfg.save_path}/bridge",
        "deadlines": cfg.sync_deadline,
    }
    if sharded and cfg.weights.type == "broadcast":
        # Under torchrun MASTER_ADDR/MASTER_PORT are the trainer's own rendezvous: the
        # broadcast group takes a free port on rank 0's host, reached at MASTER_ADDR when the
        # trainer spans nodes (rank 0 runs on node 0, the rendezvous host).
        one_node = os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE")
        kwargs["master_port"] = None
        kwargs["master_address"] = "127.0.0.1" if one_node else os.environ["MASTER_ADDR"]
    return kwargs

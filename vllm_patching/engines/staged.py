"""Common base of our CPU engines: a weight-updater thread stages, finish applies.

vLLM's worker calls ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update``
through ``collective_rpc``, which runs between engine steps. A native engine receives and
loads inside ``update_weights``, so generation is blocked for the whole transfer. Here
``update_weights`` only hands the metadata to a background weight-updater thread and
returns: the thread receives/maps the tensors while the engine keeps generating, and
``finish_weight_update`` (called by the trainer with the scheduler paused) waits for it and
applies the staged tensors. ``start_weight_update`` deliberately does *not* enter vLLM's
layerwise reload (that puts layers on the meta device and would break generation); the
reload runs entirely inside ``finish_weight_update``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from vllm_patching.engines.apply import apply_weights
from vllm_patching.transport import TensorMeta, metas_from_wire

logger = init_logger("vllm.shop_r1_bridge." + __name__.rsplit(".", 1)[-1])


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    """Per-sync metadata: the tensors the trainer is about to send (HF names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = 0
    """Bucket size the sender packed with (gloo); 0 = one bucket (shared memory)."""

    def metas(self) -> list[TensorMeta]:
        return metas_from_wire(self.names, self.dtype_names, self.shapes)


class StagedWeightTransferEngine(WeightTransferEngine[WeightTransferInitInfo, StagedUpdateInfo]):
    """Receive in a weight-updater thread, apply in ``finish_weight_update``."""

    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = False
    stage_timeout_s = 600.0

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._thread: threading.Thread | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._error: BaseException | None = None
        self._generation = 0
        """Bumped by ``abandon``: an updater thread started before keeps its result to itself."""
        self._publish = threading.Lock()
        """Makes ``abandon``'s bump and an updater thread's check-then-publish one step each."""
        self.last_timings: dict[str, Any] = {}
        self.last_path = ""
        """How the last update reached this worker (``shm``, ``gloo``), for the timings."""

    # -- subclass hooks ------------------------------------------------------------------
    def stage(self, info: StagedUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        """Runs in the weight-updater thread: return ``(hf_name, tensor)`` pairs."""
        raise NotImplementedError

    # -- vLLM engine lifecycle -----------------------------------------------------------
    def start_weight_update(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a weight update is still being received")
        self._thread, self._staged, self._error = None, None, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Start the weight-updater thread and return at once (generation continues)."""
        info = self.parse_update_info(update_info)
        if self._thread is not None:
            raise RuntimeError("update_weights called twice in one weight update")
        self._thread = threading.Thread(
            target=self._run_stage,
            args=(info, self._generation),
            name="shop-r1-weight-updater",
            daemon=True,
        )
        self._thread.start()

    def discard(self) -> None:
        """Drop a staged update that will never be applied (a sync that failed half way).

        Refuses while the weight-updater thread still receives: its buffers are in use.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a previous weight update is still being received")
        self._thread, self._staged, self._error = None, None, None

    def abandon(self) -> None:
        """Forget the current update because its transfer is being replaced (a new group or
        segment: a trainer that gave up on a sync and connected again). A weight-updater
        thread still receiving over the old transfer -- a stale /bridge/stage that a frozen
        server ran once it woke, after the trainer had dropped that transfer -- runs to its
        own end (the old peer is gone: an error, or the old group's timeout) on the buffers it
        took, and its result is dropped; the next update starts at once."""
        if self._thread is not None and self._thread.is_alive():
            logger.warning("abandoning a weight update still receiving over the old transfer")
        with self._publish:
            self._generation += 1
            self._thread, self._staged, self._error = None, None, None

    def receive_weights(self, update_info: StagedUpdateInfo) -> None:  # pragma: no cover
        raise RuntimeError("staged engines receive in their weight-updater thread")

    def _run_stage(self, info: StagedUpdateInfo, generation: int) -> None:
        t0 = time.perf_counter()
        staged, error = None, None
        try:
            staged = self.stage(info)
        except BaseException as e:  # surfaced by finish_weight_update
            error = e
        with self._publish:
            if generation != self._generation:  # abandoned: a newer update owns the engine
                logger.warning(
                    "an abandoned weight update ended (%r); its result is dropped", error
                )
                return
            if error is not None:
                logger.error("weight-updater thread failed", exc_info=error)
            self._staged, self._error = staged, error
            self.last_timings = {"stage_s": time.perf_counter() - t0, "path": self.last_path}

    def finish_weight_update(self) -> None:
        """Wait for staging, then load + finalize + tied lm_head refresh (scheduler paused)."""
        if self._thread is None:
            # Nothing staged: an empty update, or a client closing a failed one. Returning
            # lets the worker clear its "update active" flag so the next sync can start.
            logger.warning("finish_weight_update with nothing staged: no-op")
            return
        t0 = time.perf_counter()
        self._thread.join(self.stage_timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"weights not received within {self.stage_timeout_s:.0f}s")
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"receiving weights failed: {err!r}") from err
        staged, self._staged = self._staged or [], None
        t1 = time.perf_counter()
        try:
            n = apply_weights(self.model, self.model_config, staged, self.last_timings)
        finally:
            staged.clear()  # drop the staging buffers (gloo) / segment views (shm)
        self.last_timings.update(wait_s=t1 - t0, apply_s=time.perf_counter() - t1, tensors=n)
        logger.info("bridge: applied %d tensors %s", n, self.last_timings)

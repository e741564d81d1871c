"""``none``: save a safetensors checkpoint, the server reloads it in place.

Default: the server's ``/bridge/reload`` pauses (keep), loads the files through the same
apply path as the broadcast (load_weights + finalize + tied lm_head refresh), sets the
version and resumes. ``reload_every=N`` applies only every N-th sync (the others return
with ``stats.detail["skipped"]`` and the server keeps serving ``served_version``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.deadline import SyncDeadlines
from trainer.bridge.params import hf_tensors


def save_checkpoint(model: torch.nn.Module, path: Path) -> int:
    """Write the HF-format weights (+ config, for restarts) atomically. Returns bytes."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: t.contiguous() for n, t in hf_tensors(model)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return sum(f.stat().st_size for f in path.iterdir())


class CheckpointReloadBridge(WeightBridge):
    def __init__(
        self,
        server_urls: Sequence[str],
        save_dir: str | Path,
        token: str | None = None,
        keep: int = 2,
        reload_every: int = 1,
        timeout: float = 600.0,
        deadlines: SyncDeadlines | None = None,
    ) -> None:
        super().__init__(server_urls, token=token, timeout=timeout, deadlines=deadlines)
        if reload_every < 1:
            raise ValueError("reload_every must be >= 1")
        self.save_dir = Path(save_dir)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.reload_every = reload_every
        self.served_version: int | None = None
        self._saved: list[Path] = []
        self._syncs = 0

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        self._syncs += 1
        if self._syncs % self.reload_every != 0:
            stats = SyncStats(
                version=version, detail={"skipped": True, "served": self.served_version}
            )
            self.last_stats = stats
            return stats
        t0 = time.perf_counter()
        path = self.save_dir / f"v{version}"
        nbytes = save_checkpoint(model, path)
        t1 = time.perf_counter()
        answers = self._apply(path, version)
        stall = max(a["stall_s"] for a in answers)
        self.served_version = version
        self._saved.append(path)
        while len(self._saved) > self.keep:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)
        stats = SyncStats(
            version=version,
            total_s=time.perf_counter() - t0,
            pack_s=t1 - t0,
            transfer_s=time.perf_counter() - t1,
            stall_s=stall,
            bytes=nbytes,
            detail={"servers": answers},
        )
        self.last_stats = stats
        return stats

    def _apply(self, path: Path, version: int) -> list[dict]:
        """Every server reloads ``path`` in place as ``version``; their answers."""
        runs = self.runs.current()  # a server restarted after this read is re-synced later
        answers = self.each(
            lambda s: s.post(
                "/bridge/reload", json={"path": str(path.resolve()), "version": version}
            ).json(),
            "apply",
        )
        self.runs.record(runs)
        return answers

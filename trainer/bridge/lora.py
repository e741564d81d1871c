"""``lora_only``: each sync saves the peft adapter and the server serves it under a new name.

The base weights never move. The server loads ``<served-name>-v<version>`` through vLLM's
LoRA manager (no pause needed: requests already running keep their adapter, new requests
ask for the new name, see ``served_model``), sets the weight version, and unloads adapters
older than its ``--bridge-lora-keep``. Adapter folders on disk are pruned the same way.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.bridge.base import SyncStats, WeightBridge
from trainer.bridge.deadline import SyncDeadlines


class LoraBridge(WeightBridge):
    def __init__(
        self,
        server_urls: Sequence[str],
        save_dir: str | Path,
        token: str | None = None,
        keep: int = 2,
        timeout: float = 600.0,
        deadlines: SyncDeadlines | None = None,
    ) -> None:
        super().__init__(server_urls, token=token, timeout=timeout, deadlines=deadlines)
        infos = self.each(lambda s: s.info())
        for url, info in zip(server_urls, infos, strict=True):
            if info["mode"] != "lora_only":
                raise ValueError(f"{url} runs bridge mode {info['mode']!r}, not lora_only")
        self.runs.record([i["run_id"] for i in infos])
        self.save_dir = Path(save_dir)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.served_model: str | None = None
        self._saved: list[Path] = []

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            raise TypeError("lora_only needs a peft PeftModel (the adapter is what is synced)")
        t0 = time.perf_counter()
        runs = self.runs.current()  # a server restarted after this read is re-synced later
        path = self.save_dir / f"v{version}"
        tmp = self.save_dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # the server never sees a half-written adapter
        t1 = time.perf_counter()
        answers = self.each(
            lambda s: s.post(
                "/bridge/lora/load", json={"path": str(path.resolve()), "version": version}
            ).json(),
            "apply",
        )
        self.served_model = answers[0]["served_model"]
        self.runs.record(runs)
        self._saved.append(path)
        while len(self._saved) > self.keep:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)
        stats = SyncStats(
            version=version,
            total_s=time.perf_counter() - t0,
            pack_s=t1 - t0,
            transfer_s=time.perf_counter() - t1,
            stall_s=max(a["stall_s"] for a in answers),
            bytes=sum(f.stat().st_size for f in path.iterdir()),
            detail={"servers": answers},
        )
        self.last_stats = stats
        return stats

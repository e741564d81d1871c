"""Worker-side RPC methods, mixed into vLLM's worker via ``--worker-extension-cls``.

vLLM's supported way to add worker methods reachable through ``collective_rpc`` (the
endpoint plugin calls them by name); no vLLM class is replaced or patched.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from typing import Any

import torch


class BridgeWorkerExtension:
    """Methods added to every vLLM worker (``self`` is the worker)."""

    def bridge_param_map(self) -> dict[str, Any]:
        """HF checkpoint name -> vLLM parameter name and shard, for /bridge/info."""
        from vllm_patching.engines.apply import tied_lm_head

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        out: dict[str, dict[str, Any]] = {}
        for vname, _ in model.named_parameters(remove_duplicate=False):
            parts = vname.split(".")
            fused = next((p for p in parts if p in packed), None)
            if fused is None:
                out[vname] = {"vllm_name": vname, "shard": None}
                continue
            for idx, sub in enumerate(packed[fused]):
                hf = ".".join(sub if p == fused else p for p in parts)
                shard = sub.split("_")[0] if fused == "qkv_proj" else idx
                out[hf] = {"vllm_name": vname, "shard": shard, "fused_group": packed[fused]}
        lm_head = tied_lm_head(model)
        if lm_head is not None:
            out.pop("lm_head.weight", None)
        return {
            "params": out,
            "tied_embeddings": lm_head is not None,
            "rank": getattr(self, "rank", 0),
        }

    def bridge_reload_from_path(self, path: str) -> dict[str, float | str]:
        """Load every ``*.safetensors`` file under ``path`` in place (the ``none`` mode).

        A checkpoint that cannot be loaded (no file, an unreadable one, a tensor name or shape
        the model lacks) is answered ``{"error": ...}``, not raised: across ``collective_rpc``
        every exception becomes the same bare one, and /bridge/reload must tell this client
        error (422) from a failure of the server (500)."""
        from vllm.config import set_current_vllm_config

        from vllm_patching.engines.apply import apply_weights

        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not files:
            return {"error": f"no *.safetensors under {path}"}
        t0 = time.perf_counter()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                n = apply_weights(model, self.model_config, _read_safetensors(files))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 -- the checkpoint's fault, reported to the client
            return {"error": f"{type(e).__name__}: {e}"[:2000]}
        self.model_runner.reset_lora_state()  # type: ignore[attr-defined]
        return {"tensors": float(n), "apply_s": time.perf_counter() - t0}

    def bridge_last_timings(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last_timings", {}) or {})

    # -- one collective_rpc per step of a sync (each native route is one rpc per call) ----
    def bridge_stage(self, update_info: dict[str, Any]) -> None:
        """``start_weight_update`` + ``update_weights`` in one call (the updater thread
        starts; generation goes on). A session left open by a failed sync is discarded
        first (its staged tensors are never applied)."""
        try:
            self.start_weight_update()  # type: ignore[attr-defined]
        except RuntimeError as e:
            if "already active" not in str(e):
                raise
            self.weight_transfer_engine.discard()  # type: ignore[attr-defined]
            self.finish_weight_update()  # type: ignore[attr-defined]  # nothing staged: no-op
            self.start_weight_update()  # type: ignore[attr-defined]
        self.update_weights(update_info)  # type: ignore[attr-defined]

    def bridge_finish(self) -> dict[str, Any]:
        """``finish_weight_update`` (the apply; the caller paused the scheduler) and its
        timings, in one call."""
        self.finish_weight_update()  # type: ignore[attr-defined]
        return self.bridge_last_timings()

    def bridge_update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Stage and apply in one call, for transports with nothing to wait for (the bytes
        are already in shared memory): one rpc per sync instead of two."""
        self.bridge_stage(update_info)
        return self.bridge_finish()

    def bridge_bench_apply(self, path: str, repeats: int | str = 3) -> list[dict[str, float]]:
        """Benchmark only: the apply floor -- ``load_weights`` + repack + lm_head refresh from
        a state dict already in this worker's memory (read from ``path`` untimed).

        Every way of changing weights in vLLM-CPU pays this, a server restart included.
        Loads the checkpoint's weights, so call it with the weights being served.
        """
        from vllm.config import set_current_vllm_config

        from vllm_patching.engines.apply import apply_weights

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        state = [(n, t.clone()) for n, t in _read_safetensors(files)]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out = []
        for _ in range(int(repeats)):  # vLLM's /collective_rpc passes kwargs as strings
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                apply_weights(model, self.model_config, state, timings)  # type: ignore[attr-defined]
            out.append({"apply_s": time.perf_counter() - t0, **timings})
        return out


def _read_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, st.get_tensor(name)

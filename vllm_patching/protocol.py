"""Schemas of the bridge: server settings, the per-run config file and the /bridge/* routes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

BridgeMode = Literal["shared_vllm", "lora_only", "none"]
"""How trainer weights reach a vLLM server (docs/BRIDGE.md): the server's
``--weight-bridge-mode``, the trainer's old ``weight_bridge_mode`` (its transports,
trainer/weights_config.py, each name one); the one definition of these values."""
TOKEN_ENV = "SHOP_R1_BRIDGE_TOKEN"
"""Environment variable holding the shared token (never written to disk by the bridge)."""
SETTINGS_ENV = "SHOP_R1_BRIDGE_SETTINGS"
"""serve.py -> plugin: the BridgeSettings JSON of this run (same process, set before vLLM)."""
TOKEN_HEADER = "x-shop-r1-bridge-token"
"""Header carrying the token (``Authorization: Bearer`` is accepted too)."""
VERSION_HEADER = "x-weight-version"
"""Set on completion responses: the weight version when the request arrived."""
PLUGIN_NAME = "shop_r1_bridge"
"""Name of both entry points (general + endpoint plugin); what VLLM_PLUGINS must list."""


class BridgeSettings(BaseModel):
    """What ``vllm_patching.serve`` decided for this run; read by the plugin at start-up."""

    mode: BridgeMode = Field("shared_vllm", description="How the trainer pushes new weights.")
    single_copy: bool = Field(
        False, description="shared_vllm only: same-device transfer (shm on CPU, CUDA IPC on GPU)."
    )
    backend: str | None = Field(
        None, description="vLLM weight-transfer backend (gloo_bcast, shm, nccl, ipc) or None."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device the workers run on.")
    initial_version: int = Field(0, description="weight_version reported before the first sync.")
    lora_keep: int = Field(
        2, description="lora_only: adapters kept loaded (older ones are unloaded after a swap)."
    )
    run_id: str = Field(description="Random id of this server run (a restart gets a new one).")
    config_path: str = Field(description="Where the per-run bridge config JSON is written.")
    served_model_name: str = Field(description="Name the base model is served under.")
    insecure_no_token: bool = Field(
        False, description="Served without a token on a non-loopback address, by the opt-out."
    )


class BridgeConfigFile(BaseModel):
    """The per-run ``vllm_bridge_config.json``: written at start, never read back as truth
    (a restarted server overwrites it; a stale one from a dead run is only reported)."""

    run_id: str = Field(description="Run that wrote the file.")
    pid: int = Field(description="PID of the server process that wrote it.")
    host: str = Field(description="Host the OpenAI server binds.")
    port: int = Field(description="Port the OpenAI server binds.")
    settings: BridgeSettings = Field(description="Bridge settings of that run.")
    started_at: float = Field(description="Unix time the server started.")


class ParamEntry(BaseModel):
    """Where one HF checkpoint tensor lands in vLLM."""

    vllm_name: str = Field(description="vLLM parameter name (fused for q/k/v, gate/up).")
    shard: str | int | None = Field(description="Shard id inside the fused parameter, or None.")
    fused_group: list[str] | None = Field(
        None, description="All HF sub-modules of the fused parameter (send them together)."
    )


class BridgeInfo(BaseModel):
    """GET /bridge/info."""

    mode: BridgeMode = Field(description="Bridge mode of this server.")
    single_copy: bool = Field(description="Whether the single-copy transport is in use.")
    backend: str | None = Field(description="vLLM weight-transfer backend name.")
    device: str = Field(description="cpu or cuda.")
    weight_version: str = Field(description="Version of the weights now served.")
    world_size: int = Field(description="Workers per server (TP x PP): receivers to count.")
    dtype: str = Field(description="Model dtype in vLLM.")
    model: str = Field(description="Model path or hub id the server started from.")
    served_model: str = Field(
        description="Model name to request for the current version (the LoRA name in lora_only)."
    )
    tied_embeddings: bool = Field(description="lm_head shares the input embedding.")
    param_map: dict[str, ParamEntry] = Field(description="HF name -> vLLM name / shard.")
    run_id: str = Field(description="Id of this server run.")
    pid: int = Field(description="Server PID.")


class StageRequest(BaseModel):
    """POST /bridge/stage (shared_vllm): start receiving an update (start + update_weights)."""

    update_info: dict[str, Any] = Field(
        description="The engine's update info: names, dtype_names, shapes, bucket_bytes."
    )
    run_id: str | None = Field(
        None,
        description="Server run the trainer set its transfer up with; a different one "
        "(the server restarted) is refused with 409 before anything is staged.",
    )


class ApplyRequest(BaseModel):
    """POST /bridge/apply (shared_vllm): apply the staged weights as ``version``."""

    version: int = Field(ge=0, description="weight_version the staged weights represent.")
    run_id: str | None = Field(
        None, description="As in /bridge/stage: 409 if the server run is another one."
    )
    update_info: dict[str, Any] | None = Field(
        None,
        description="Stage this update first, inside the same pause (for transports whose "
        "bytes are already in place: shared memory); None = apply what /bridge/stage staged.",
    )


class ReloadRequest(BaseModel):
    """POST /bridge/reload (mode none): load a safetensors checkpoint in place."""

    path: str = Field(description="Folder with *.safetensors in HF checkpoint format.")
    version: int = Field(ge=0, description="weight_version the checkpoint represents.")


class LoraLoadRequest(BaseModel):
    """POST /bridge/lora/load (mode lora_only): serve a peft adapter as the new version."""

    path: str = Field(description="Folder of a peft adapter (adapter_config.json + weights).")
    version: int = Field(ge=0, description="weight_version the adapter represents.")


class SyncResult(BaseModel):
    """Answer of the server-orchestrated syncs (/bridge/reload, /bridge/lora/load)."""

    weight_version: str = Field(description="Version now served.")
    served_model: str = Field(description="Model name to request from now on.")
    stall_s: float = Field(description="Seconds generation was paused.")
    detail: dict[str, Any] = Field(default_factory=dict, description="Per-worker timings.")

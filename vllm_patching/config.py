"""``VllmConfig``: the ``vllm:`` section of a run (docs/RECIPES.md), the options of
``python -m vllm_patching.serve``: the bridge's own and the vLLM options this project sets,
typed and documented; any other key is one of vLLM's own options, passed on as it is
(``key: value`` -> ``--key value``, ``vllm_patching.serve.mapping_argv``), for vLLM to check.

Imports neither vLLM nor torch (the launcher reads it).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_patching.protocol import BridgeMode

HumanInt = Annotated[str, Field(pattern=r"^\s*(auto|-1|\d+(\.\d+)?[kKmMgGtT])\s*$")]
"""vLLM's way of writing a length: ``4k`` (4000), ``4K`` (4096), ``auto`` / ``-1``."""


class VllmConfig(BaseModel):
    """``vllm:``: the bridge's options and vLLM's own; a key not declared here is a vLLM
    argument passed on untyped (vLLM's own parser checks it)."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)
    shortcuts: ClassVar[dict[str, str]] = {
        "model": "model",
        "seed": "seed",
        "weight_bridge_mode": "weight_bridge_mode",
        "single_copy": "single_copy",
    }
    """A run's top-level keys that fill these fields (``settings.layers.Rules``)."""

    model: str | None = None
    """Model directory or hub id vLLM serves."""
    seed: int | None = None
    """vLLM's seed."""
    weight_bridge_mode: BridgeMode | None = None
    """How trainer weights reach this server (docs/BRIDGE.md)."""
    single_copy: bool | None = None
    """shared_vllm: one weight copy in shared memory (CPU) / CUDA IPC (GPU)."""
    bridge_config: str | None = None
    """Where the server writes vllm_bridge_config.json (default:
    $TMPDIR/shop_r1_bridge/<run_id>/vllm_bridge_config.json)."""
    insecure_no_token: bool | None = None
    """Serve on a non-loopback ``host`` without $SHOP_R1_BRIDGE_TOKEN (a trusted private
    network only; logged as INSECURE). Without it such a bind refuses to start. Never allows
    ``single_copy`` on CUDA (pickled IPC handles) without the token."""
    bridge_device: Literal["auto", "cpu", "cuda"] | None = None
    """Device of the vLLM workers (picks the weight-transfer backend)."""
    bridge_initial_version: int | None = Field(None, ge=0)
    """Weight version served before the first sync."""
    bridge_lora_keep: int | None = Field(None, ge=1)
    """lora_only: adapters kept loaded, the newest ones."""
    enforce_eager: bool | None = None
    """Run the model eagerly, without CUDA graphs / torch.compile (the launcher's default for
    what a run leaves unset: true, ``launch.vllm_server.SERVER_DEFAULTS``)."""
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = None
    """Weights' and activations' dtype (the launcher's default: float32)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of each GPU's memory vLLM may take (weights, activations, KV cache)."""
    max_model_len: int | HumanInt | None = None
    """Context length, prompt + completion (``4k``, ``auto``; the launcher's default: 2048)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences batched per step (the rollouts one server runs at once)."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of shared prompt prefixes (a group's G completions share theirs)."""
    served_model_name: str | None = None
    """Model name the OpenAI API answers to (the launcher names it itself)."""
    tensor_parallel_size: int | None = Field(None, ge=1)
    """GPUs per server (a run sets ``launch.tensor_parallel_size``, ``--tensor-parallel-size``,
    which also places the GPUs and reaches vLLM as a flag over this)."""
    host: str | None = None
    """Interface to listen on (serve's default: 127.0.0.1; the launcher's own). Any
    non-loopback one needs $SHOP_R1_BRIDGE_TOKEN (or ``insecure_no_token``)."""
    port: int | None = Field(None, ge=1, le=65535)
    """Port to listen on (serve's default: settings.ports.VLLM_PORT; the launcher's own)."""

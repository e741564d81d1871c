"""General plugin (``vllm.general_plugins``): runs in every vLLM process, workers included.

It registers our CPU weight-transfer engines in vLLM's engine factory (lazily, by module
path), which is vLLM's extension point for new transports, and on the CPU honours an explicit
``VLLM_WORKER_MULTIPROC_METHOD=fork`` (``keep_fork_on_cpu``). Idempotent: vLLM may call it
several times per process.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from procutil.faults import fault_point

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.shop_r1_bridge.plugin")


def keep_fork_on_cpu() -> None:
    """vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks the
    config, whatever the user asked, so the OpenAI server's engine-core process imports vLLM
    and torch again (~11 s of a ~25 s start on 2 cores). When the variable says ``fork``
    (``launch.vllm_server.cpu_env`` sets it), this puts it back after that check, and the
    engine core is forked from the server, as vLLM does on CUDA before CUDA is initialised.
    Only at world size 1 (one worker, inside the engine core; tensor or pipeline parallel
    workers on the CPU keep vLLM's spawn). Not applied on other platforms. The forked engine
    core says so in the server's log (tests/integration/vllm_patching/test_bridge_modes.py checks it)
    and, for a test, can stop there (the fault point ``engine_core_forked``, procutil/faults.py)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if getattr(cls, "_shop_r1_keeps_fork", False):
        return
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "fork" or not current_platform.is_cpu():
        return
    checked = cls.check_and_update_config.__func__

    def check_and_update_config(platform: type, vllm_config: VllmConfig) -> None:
        checked(platform, vllm_config)
        if vllm_config.parallel_config.world_size == 1:  # more workers: vLLM's spawn
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cls.check_and_update_config = classmethod(check_and_update_config)
    cls._shop_r1_keeps_fork = True
    server = os.getpid()

    def forked_engine_core() -> None:  # the server forks only its engine core
        print(f"[bridge] engine core forked from server pid {server}", flush=True)
        fault_point("engine_core_forked")  # test-only (procutil/faults.py): unset, nothing

    os.register_at_fork(after_in_child=forked_engine_core)


def register() -> None:
    keep_fork_on_cpu()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_patching.engines import ENGINES

    for name, (module, cls) in ENGINES.items():
        if name in WeightTransferEngineFactory._registry:
            continue
        WeightTransferEngineFactory.register_engine(name, module, cls)
    logger.debug("shop-r1 bridge engines registered: %s", sorted(ENGINES))

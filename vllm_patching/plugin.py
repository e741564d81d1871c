"""General plugin (``vllm.general_plugins``): runs in every vLLM process, workers included.

It only registers our CPU weight-transfer engines in vLLM's engine factory (lazily, by
module path), which is vLLM's extension point for new transports. Idempotent: vLLM may call
it several times per process.
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger("vllm.shop_r1_bridge.plugin")


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_patching.engines import ENGINES

    for name, (module, cls) in ENGINES.items():
        if name in WeightTransferEngineFactory._registry:
            continue
        WeightTransferEngineFactory.register_engine(name, module, cls)
    logger.debug("shop-r1 bridge engines registered: %s", sorted(ENGINES))

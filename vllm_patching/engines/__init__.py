"""Worker-side weight-transfer engines registered into vLLM's engine factory.

- ``gloo_bcast``: gloo broadcast from the trainer (rank 0) to every worker -- the CPU analogue
  of vLLM's native ``nccl`` engine.
- ``shm``: POSIX shared memory written by the trainer and read in place by the workers -- the
  CPU analogue of the native CUDA ``ipc`` engine (single copy).

Both stage the incoming tensors in a weight-updater thread while generation goes on and
apply them in ``finish_weight_update`` (see ``apply.py``), which the trainer calls while the
scheduler is paused.
"""

ENGINES = {
    "gloo_bcast": ("vllm_patching.engines.gloo", "GlooBroadcastWeightTransferEngine"),
    "shm": ("vllm_patching.engines.shm", "SharedMemoryWeightTransferEngine"),
}
"""Backend name -> (module, class), registered lazily by ``vllm_patching.plugin.register``."""

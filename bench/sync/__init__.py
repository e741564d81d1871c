"""Weight sync from the trainer to vLLM: the bridge modes' latency and stall (``bridge_sync``),
sharded trainers' send paths (``sharded_paths``).
"""

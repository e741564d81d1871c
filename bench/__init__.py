"""The benchmarks, one folder per question (docs/BENCHMARKS.md): ``sync`` (weight sync),
``api`` (the batching API), ``rollout`` (generation through the env service and vLLM),
``trainer`` (step time, memory, sharding), ``learning`` (does training improve the model),
``peers`` (against TRL), ``faults`` (kills, full disks, OOM, the soak), ``report`` (tables and
plots from the results). Each script runs as a module from the repository root, e.g.
``python -m bench.sync.bridge_sync --help``; ``bench/common.py`` holds what they share.
"""

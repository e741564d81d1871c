"""Generation: the env service's overhead over vLLM (``overhead``), evaluation concurrency,
vLLM's start time.
"""

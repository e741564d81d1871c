"""The trainer: step time by size, precision, packing and kernels, the step's breakdown, FSDP
scaling, the thread plan.
"""

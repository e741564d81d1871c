"""Faults on purpose: torn checkpoints, the one-hour soak, and the small disk and memory cgroup
the fault tests use.
"""

"""How many CPU threads each process of launch/run_all.sh may spin (a pure plan + its log line).

Left alone, every process sizes its OpenMP pool to the whole machine: the trainer's torch
takes one thread per core, and vLLM-CPU's ``auto`` binding pins its worker to every core but
one (on 2 cores: core 0, while core 1 is "reserved" for its front end -- and a second server
lands on core 0 too). On a small box the pools then fight: an OpenMP team waits at every
barrier for its slowest thread, and a thread preempted by another pool stalls the whole team.

The plan (CPU presets) splits the cores this process may use (``os.sched_getaffinity``)
between the compute-bound processes -- each vLLM server and the trainer:

- ``share = max(1, cores // (servers + 1))``;
- when every server can have cores of its own (``cores >= servers + 1``), server ``i`` gets
  ``share`` cores from the end of the list, bound (``VLLM_CPU_OMP_THREADS_BIND``, vLLM's
  own pinning, as vLLM recommends), and the trainer ``cores - servers * share`` threads,
  unpinned; otherwise every server gets one thread, unpinned (``nobind``), and so does the
  trainer;
- the API, the environment service and the evaluation clients do little arithmetic: one
  thread each (``OMP_NUM_THREADS=1``);
- the SFT-vs-RL evaluations run while nothing else computes: their server gets every core
  (``alone_server``).

2 cores, one server: vLLM on core 1 (1 thread), trainer 1 thread. 16 cores, two servers:
vLLM on cores 11-15 and 6-10 (5 threads each), trainer 6 threads. A value the user set
(``OMP_NUM_THREADS``, ``VLLM_CPU_OMP_THREADS_BIND``) is kept, and the vLLM servers then get
nothing from the plan (vLLM applies the user's values, its own binding otherwise). CUDA presets: vLLM and the
trainer keep their own defaults (their arithmetic runs on the GPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, Field


class ThreadPlan(BaseModel):
    """Environment variables per kind of process, and what the plan was made from."""

    cores: list[int] = Field(description="The CPUs this launcher may use (its affinity).")
    server_env: list[dict[str, str]] = Field(description="Per vLLM server, what it gets.")
    trainer_env: dict[str, str] = Field(description="What the trainer gets.")
    light_env: dict[str, str] = Field(description="What the API, env and eval clients get.")
    kept: list[str] = Field(description="Variables the user set, kept as they are.")

    def for_server(self, i: int) -> dict[str, str]:
        return dict(self.server_env[i])

    def alone_server(self) -> dict[str, str]:
        """What a vLLM server gets that computes alone (an evaluation: no trainer, no other
        server at work): every core, pinned; nothing where the user set the threads or on
        CUDA (as ``server_env`` there)."""
        if self.kept or not self.server_env[0]:
            return {}
        return pinned_server(self.cores)

    def describe(self) -> str:
        """One log line: what each process gets."""
        parts = []
        for i, env in enumerate(self.server_env):
            bind = env.get("VLLM_CPU_OMP_THREADS_BIND")
            if bind is None:
                parts.append(f"vLLM server {i}: vLLM's defaults")
            elif bind == "nobind":
                parts.append(f"vLLM server {i}: {env['OMP_NUM_THREADS']} thread(s), unpinned")
            else:
                parts.append(f"vLLM server {i}: {env['OMP_NUM_THREADS']} thread(s) on cores {bind}")
        parts.append(f"trainer: {self.trainer_env.get('OMP_NUM_THREADS', 'default')} thread(s)")
        parts.append(f"api/env/eval: {self.light_env.get('OMP_NUM_THREADS', 'default')}")
        kept = f"; kept from the environment: {', '.join(self.kept)}" if self.kept else ""
        return (
            f"threads on {len(self.cores)} core(s) {_ranges(self.cores)}: "
            + "; ".join(parts)
            + kept
        )


def pinned_server(cores: Sequence[int]) -> dict[str, str]:
    """A vLLM CPU server's OpenMP threads: one per core of ``cores``, each pinned."""
    return {"VLLM_CPU_OMP_THREADS_BIND": _ranges(cores), "OMP_NUM_THREADS": str(len(cores))}


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (vLLM's CPU-list syntax)."""
    out: list[str] = []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def light_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the API, the env service and the evaluation clients get: one OpenMP thread,
    unless the user set ``OMP_NUM_THREADS``."""
    env = os.environ if environ is None else environ
    return {} if "OMP_NUM_THREADS" in env else {"OMP_NUM_THREADS": "1"}


def available_cores() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_threads(
    cores: Sequence[int],
    num_servers: int,
    device: str = "cpu",
    environ: Mapping[str, str] | None = None,
) -> ThreadPlan:
    """The thread plan for ``num_servers`` vLLM servers and one trainer on ``cores``
    (see the module docstring); ``environ``'s own values win."""
    if not cores or num_servers < 1:
        raise ValueError(f"need at least one core and one server, got {cores!r}, {num_servers}")
    env = os.environ if environ is None else environ
    cores = sorted(cores)
    kept = [k for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND") if k in env]
    light = light_env(env)
    if device != "cpu":
        no_change: list[dict[str, str]] = [{} for _ in range(num_servers)]
        return ThreadPlan(
            cores=cores, server_env=no_change, trainer_env={}, light_env=light, kept=kept
        )
    n = len(cores)
    share = max(1, n // (num_servers + 1))
    own_cores = n >= num_servers + 1
    servers: list[dict[str, str]] = []
    for i in range(num_servers):
        if kept:  # the user chose: vLLM applies it (and its own binding otherwise)
            servers.append({})
        elif own_cores:
            block = cores[n - (i + 1) * share : n - i * share]
            bind = {"VLLM_CPU_OMP_THREADS_BIND": _ranges(block), "OMP_NUM_THREADS": str(share)}
            servers.append(bind)
        else:
            servers.append({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    trainer_threads = n - num_servers * share if own_cores else 1
    trainer = {} if "OMP_NUM_THREADS" in env else {"OMP_NUM_THREADS": str(trainer_threads)}
    return ThreadPlan(
        cores=cores, server_env=servers, trainer_env=trainer, light_env=light, kept=kept
    )

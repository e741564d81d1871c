"""launch/threads.py: each compute process gets its own share of the cores, the light ones
one thread, and what the user set wins."""

from __future__ import annotations

import pytest

from launch.threads import available_cores, plan_threads

pytestmark = pytest.mark.unit


def test_two_cores_one_server_split_between_vllm_and_trainer() -> None:
    plan = plan_threads([0, 1], 1, environ={})
    assert plan.server_env == [{"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}]
    assert plan.trainer_env == {"OMP_NUM_THREADS": "1"}
    assert plan.light_env == {"OMP_NUM_THREADS": "1"}
    assert plan.describe() == (
        "threads on 2 core(s) 0-1: vLLM server 0: 1 thread(s) on cores 1; trainer: 1 thread(s); "
        "api/env/eval: 1"
    )


def test_more_servers_than_spare_cores_run_unpinned() -> None:
    """2 cores, 2 servers + trainer: nobody gets a core of its own, so nobody is pinned
    (vLLM's `auto` would pin both servers to core 0)."""
    plan = plan_threads([0, 1], 2, environ={})
    assert plan.server_env == [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}] * 2
    assert plan.trainer_env == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("n_cores", [1, 2, 3, 4, 7, 16, 64])
@pytest.mark.parametrize("n_servers", [1, 2, 3])
def test_bound_servers_get_disjoint_cores_and_nothing_is_oversubscribed(
    n_cores: int, n_servers: int
) -> None:
    cores = list(range(100, 100 + n_cores))  # not 0-based: the affinity of a container
    plan = plan_threads(cores, n_servers, environ={})
    bound: list[int] = []
    for env in plan.server_env:
        bind = env["VLLM_CPU_OMP_THREADS_BIND"]
        if bind == "nobind":
            assert env["OMP_NUM_THREADS"] == "1"
            continue
        lo, _, hi = bind.partition("-")
        block = list(range(int(lo), int(hi or lo) + 1))
        assert len(block) == int(env["OMP_NUM_THREADS"])
        bound += block
    assert len(bound) == len(set(bound)) and set(bound) <= set(cores)
    threads = sum(int(e["OMP_NUM_THREADS"]) for e in plan.server_env)
    threads += int(plan.trainer_env["OMP_NUM_THREADS"])
    assert threads == max(n_cores, n_servers + 1)  # every core used, none twice when possible


def test_user_values_win_and_cuda_leaves_the_heavy_processes_alone() -> None:
    plan = plan_threads([0, 1], 1, environ={"OMP_NUM_THREADS": "2"})
    assert plan.server_env == [{}] and plan.trainer_env == {} and plan.light_env == {}
    assert plan.kept == ["OMP_NUM_THREADS"]
    plan = plan_threads([0, 1], 1, environ={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert plan.server_env == [{}] and plan.trainer_env == {"OMP_NUM_THREADS": "1"}
    assert "kept from the environment: VLLM_CPU_OMP_THREADS_BIND" in plan.describe()
    plan = plan_threads(list(range(8)), 2, "cuda", environ={})
    assert plan.server_env == [{}, {}] and plan.trainer_env == {}
    assert plan.light_env == {"OMP_NUM_THREADS": "1"}


def test_bad_input_and_this_machine() -> None:
    with pytest.raises(ValueError, match="at least one core"):
        plan_threads([], 1, environ={})
    assert available_cores() and plan_threads(available_cores(), 1).cores


def test_an_evaluation_server_alone_gets_every_core_pinned() -> None:
    """The SFT-vs-RL evaluations run while nothing else computes: their server has every core
    of the launcher, not the run's share; what the user set, and CUDA, are left alone."""
    plan = plan_threads([0, 1], 1, environ={})
    assert plan.alone_server() == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}
    plan = plan_threads([4, 5, 6, 9], 2, environ={})  # a container's affinity, two servers
    assert plan.alone_server() == {"VLLM_CPU_OMP_THREADS_BIND": "4-6,9", "OMP_NUM_THREADS": "4"}
    assert plan_threads([0, 1], 1, environ={"OMP_NUM_THREADS": "2"}).alone_server() == {}
    assert plan_threads([0, 1], 1, "cuda", environ={}).alone_server() == {}

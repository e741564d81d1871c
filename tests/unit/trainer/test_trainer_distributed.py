"""The torchrun/FSDP2 plumbing that needs no process group: launch detection, the split of
micro-batches over ranks, optimizer-state re-keying, the launcher's torchrun command, the
multi-node command hand-off and the GPU placement of several trainer ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.placement import PlacementError, plan_placement
from launch.trainer_node import ARGV_FILE, for_node, publish_trainer_argv
from trainer.dist_checkpoint import optimizer_by_name
from trainer.distributed import Work, launched_by_torchrun

pytestmark = pytest.mark.unit
TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "29500",
}


def test_only_torchrun_ranks_are_distributed() -> None:
    assert launched_by_torchrun(TORCHRUN_ENV)
    assert not launched_by_torchrun({})
    assert not launched_by_torchrun({"MASTER_ADDR": "h", "MASTER_PORT": "1"})  # Atropos bridge
    assert not launched_by_torchrun({**TORCHRUN_ENV, "RANK": ""})


def test_split_covers_every_chunk_once_with_equal_counts() -> None:
    chunks = list("abcde")
    assert Work().split(chunks) == [(c, True) for c in chunks]
    shares = [Work(r, 3).split(chunks) for r in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]  # same number of passes on every rank
    real = sorted(c for s in shares for c, ok in s if ok)
    assert real == chunks  # each micro-batch trained on exactly one rank
    assert shares[2][-1] == ("a", False)  # the padding pass
    assert Work(1, 2).split(["a"]) == [("a", False)]
    assert Work().sum({"x": 1.5}) == {"x": 1.5}


def test_single_process_optimizer_state_keyed_by_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    from trainer.config import SftConfig
    from trainer.optim import build_optimizer

    opt = build_optimizer(model, SftConfig(weight_decay=0.1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    by_name = optimizer_by_name(model, opt.state_dict())
    params = dict(model.named_parameters())
    assert by_name["param_groups"][0]["params"] == ["0.weight"]  # matrices first (decay)
    assert by_name["param_groups"][1]["params"] == ["0.bias", "1.weight", "1.bias"]
    for name, state in by_name["state"].items():
        assert torch.equal(state["exp_avg"], opt.state[params[name]]["exp_avg"]), name


def test_run_all_runs_the_trainer_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    from launch.run_config import parse_args
    from launch.run_plan import trainer_launcher
    from launch.supervisor import PY, ServiceFailed

    one = parse_args([])
    assert trainer_launcher(one, {}) == [PY]
    two = parse_args(["--trainer-procs", "2"])
    assert trainer_launcher(two, {})[-2:] == ["--nproc-per-node=2", "--standalone"]
    nodes = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    argv = trainer_launcher(two, nodes)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--node-rank=0", "--master-addr=n0", "--master-port=29500"} <= set(argv)
    with pytest.raises(ServiceFailed, match="NODE_RANK"):
        trainer_launcher(two, {"NNODES": "2"})


def test_other_nodes_run_node_zeros_command(tmp_path: Path) -> None:
    argv = ["py", "-m", "torch.distributed.run", "--node-rank=0", "-m", "trainer", "grpo"]
    path = publish_trainer_argv(tmp_path, argv)
    assert path.name == ARGV_FILE and path.stat().st_mode & 0o777 == 0o600  # holds the token
    assert for_node(argv, 3)[3] == "--node-rank=3"
    with pytest.raises(ValueError, match="multi-node"):
        for_node(["py", "-m", "trainer", "grpo"], 1)


def test_gpu_placement_of_several_trainer_ranks() -> None:
    p = plan_placement("cuda", "shared_vllm", False, 1, 2, list("012345"), trainer_procs=4)
    assert p.server_gpus == [["0", "1"]] and p.trainer_gpus == ["2", "3", "4", "5"]
    assert p.trainer_device == "cuda" and not p.shares_gpu
    with pytest.raises(PlacementError, match="need 6 GPU"):
        plan_placement("cuda", "lora_only", False, 1, 2, list("0123"), trainer_procs=4)
    with pytest.raises(PlacementError, match="single-copy"):
        plan_placement("cuda", "shared_vllm", True, 1, 1, list("0123"), trainer_procs=2)
    cpu = plan_placement("cpu", "shared_vllm", False, 1, 1, [], trainer_procs=2)
    assert cpu.trainer_device == "cpu"


def test_metrics_of_other_ranks_go_nowhere(tmp_path: Path) -> None:
    from trainer.metrics import MetricsLogger

    quiet = MetricsLogger(None, tb_dir=tmp_path / "tb")
    quiet.log(1, {"loss": 1.0})
    quiet.close()
    assert not any(tmp_path.iterdir())

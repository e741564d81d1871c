"""How launch/run_all.sh places its processes and builds their command lines and environments
(pure functions: the GPU layouts are checked here because CI has no GPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from env_server.config import EnvConfig
from env_server.inference import InferencePool
from launch.configs import resolve_for_run, vllm_values
from launch.placement import PlacementError, num_servers_from_env, plan_placement, visible_gpus
from launch.prepare import context_warning
from launch.run_config import RunConfig, parse_args
from launch.run_plan import placement, trainer_argv, trainer_env, vllm_extra, vllm_names
from launch.supervisor import ServiceFailed
from launch.vllm_server import server_env
from trainer.bridge import rendezvous_from_env
from vllm_patching.protocol import TOKEN_ENV

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ number of servers, GPUs
def test_num_servers_follows_atropos_num_inference_nodes() -> None:
    assert num_servers_from_env({}) == 1
    assert num_servers_from_env({"NUM_INFERENCE_NODES": "0"}) == 1  # Atropos: 0 = local
    assert num_servers_from_env({"NUM_INFERENCE_NODES": "3"}) == 3
    with pytest.raises(PlacementError, match="NUM_INFERENCE_NODES"):
        num_servers_from_env({"NUM_INFERENCE_NODES": "two"})
    with pytest.raises(PlacementError, match=">= 0"):
        num_servers_from_env({"NUM_INFERENCE_NODES": "-1"})


def test_cli_flag_beats_env_and_bad_env_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NUM_INFERENCE_NODES", "2")
    assert parse_args([]).launch.num_inference_servers == 2
    assert parse_args(["--num-inference-servers", "3"]).launch.num_inference_servers == 3
    monkeypatch.setenv("NUM_INFERENCE_NODES", "many")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "NUM_INFERENCE_NODES must be a number" in capsys.readouterr().err
    monkeypatch.delenv("NUM_INFERENCE_NODES")
    with pytest.raises(SystemExit):
        parse_args(["--num-inference-servers", "0"])


def test_visible_gpus_from_cuda_visible_devices() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,5"}) == ["2", "3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


# -------------------------------------------------------------------------- GPU layouts
def test_cpu_places_everything_on_the_machine() -> None:
    p = plan_placement("cpu", "shared_vllm", False, 2, 1, [])
    assert p.server_gpus == [[], []] and p.trainer_gpus == [] and p.trainer_device == "cpu"


def test_broadcast_puts_the_trainer_on_its_own_gpu() -> None:
    p = plan_placement("cuda", "shared_vllm", False, 1, 2, ["0", "1", "2", "3"])
    assert p.server_gpus == [["0", "1"]]  # tensor parallel 2
    assert p.trainer_gpus == ["2"] and p.trainer_device == "cuda:0" and not p.shares_gpu


def test_broadcast_without_a_spare_gpu_is_refused_with_the_reason() -> None:
    with pytest.raises(PlacementError, match="NCCL broadcast needs its own GPU.*--single-copy"):
        plan_placement("cuda", "shared_vllm", False, 1, 1, ["0"])


def test_single_copy_shares_the_servers_gpu() -> None:
    p = plan_placement("cuda", "shared_vllm", True, 1, 1, ["0"])
    assert p.server_gpus == [["0"]] and p.trainer_gpus == ["0"] and p.shares_gpu


def test_nccl_broadcast_feeds_several_servers_from_its_own_gpu() -> None:
    p = plan_placement("cuda", "shared_vllm", False, 2, 2, [str(i) for i in range(5)])
    assert p.server_gpus == [["0", "1"], ["2", "3"]] and p.trainer_gpus == ["4"]
    assert not p.shares_gpu
    with pytest.raises(PlacementError, match=r"NCCL broadcast needs its own GPU\) need 5 GPU") as e:
        plan_placement("cuda", "shared_vllm", False, 2, 2, ["0", "1", "2", "3"])
    assert "--single-copy" not in str(e.value)  # IPC would be refused here


@pytest.mark.parametrize(("servers", "tp"), [(1, 2), (2, 1)])
def test_single_copy_beyond_one_gpu_is_refused_at_start_up(servers: int, tp: int) -> None:
    with pytest.raises(PlacementError, match="--single-copy .*trainer's GPU.*drop --single-copy"):
        plan_placement("cuda", "shared_vllm", True, servers, tp, ["0", "1", "2", "3"])
    cfg = parse_args(
        ["--preset", "gpu-0.5b", "--gpus", "0,1,2", "--single-copy"]
        + ["--tensor-parallel-size", str(tp), "--num-inference-servers", str(servers)]
    )
    with pytest.raises(ServiceFailed, match="gpu-0.5b.*single-copy"):
        placement(cfg)


def test_several_servers_each_get_their_own_gpus() -> None:
    p = plan_placement("cuda", "lora_only", False, 3, 2, [str(i) for i in range(7)])
    assert p.server_gpus == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert p.trainer_gpus == ["6"] and not p.shares_gpu
    p = plan_placement("cuda", "none", False, 2, 1, ["4", "7"])  # no spare GPU: share the first
    assert p.server_gpus == [["4"], ["7"]] and p.trainer_gpus == ["4"] and p.shares_gpu
    with pytest.raises(PlacementError, match="need 4 GPU"):
        plan_placement("cuda", "none", False, 2, 2, ["0", "1"])


def test_gpu_preset_placement_errors_name_the_preset() -> None:
    with pytest.raises(ServiceFailed, match="gpu-0.5b.*need 2 GPU"):
        placement(parse_args(["--preset", "gpu-0.5b", "--gpus", "0"]))
    p = placement(parse_args(["--preset", "gpu-0.5b", "--gpus", "3,5"]))
    assert p.server_gpus == [["3"]] and p.trainer_gpus == ["5"]
    assert trainer_env(p)["CUDA_VISIBLE_DEVICES"] == "5"


# --------------------------------------------------------------------- argv / environment
def _configs(
    argv: list[str], tmp_path: Path, urls: list[str] | None = None, device: str = "cpu"
) -> RunConfig:
    """The run config launch/run_all.sh ``argv`` would write the services' files from."""
    return resolve_for_run(argv, "http://api:1", urls or ["http://v:2"], tmp_path, device)


def test_trainer_config_lists_every_server_and_the_placed_device(tmp_path: Path) -> None:
    argv = ["--num-inference-servers", "2", "--single-copy"]
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cfg = _configs(argv, tmp_path, urls, "cuda:0")
    grpo = cfg.trainer.grpo
    assert grpo.inference_urls() == urls
    assert grpo.device == "cuda:0" and grpo.single_copy
    argv = trainer_argv(cfg, Path("c.yaml"), "tok")
    assert argv[-4:] == ["--config", "c.yaml", "--bridge-token", "tok"]


def test_vllm_names_and_tensor_parallel_flag(tmp_path: Path) -> None:
    import yaml

    assert vllm_names(1) == ["vllm"] and vllm_names(3) == ["vllm", "vllm1", "vllm2"]
    cfg = parse_args(["--preset", "gpu-3b"])
    assert "--tensor-parallel-size" not in vllm_extra(cfg)
    # the preset's vLLM options go into <run>/config/vllm.yaml, read before the flags
    assert yaml.safe_load(yaml.safe_dump(vllm_values(cfg))) == {
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
    }
    extra = vllm_extra(parse_args(["--preset", "gpu-3b", "--tensor-parallel-size", "4"]))
    assert extra[-2:] == ["--tensor-parallel-size", "4"]
    cfg = parse_args(["--preset", "gpu-3b", "--vllm-args=--gpu-memory-utilization 0.3"])
    assert vllm_extra(cfg)[-2:] == ["--gpu-memory-utilization", "0.3"]  # last wins


def test_server_env_cpu_and_cuda() -> None:
    base = {
        "PATH": "/bin",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    cpu = server_env("tok", "cpu", [], base=base)
    assert cpu["VLLM_TARGET_DEVICE"] == "cpu" and cpu["HF_HUB_OFFLINE"] == "1"
    assert cpu[TOKEN_ENV] == "tok" and "MASTER_PORT" not in cpu
    gpu = server_env("tok", "cuda", ["2", "3"], base=base)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and gpu[TOKEN_ENV] == "tok"
    assert "VLLM_TARGET_DEVICE" not in gpu  # would force vLLM's CPU platform
    assert "HF_HUB_OFFLINE" not in gpu  # hub model ids must download
    assert "MASTER_ADDR" not in gpu and "MASTER_PORT" not in gpu  # the trainer's, not vLLM's


def test_rendezvous_from_master_addr_and_port() -> None:
    assert rendezvous_from_env({}) == {}
    assert rendezvous_from_env({"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"}) == {
        "master_address": "10.1.2.3",
        "master_port": 29511,
    }
    with pytest.raises(ValueError, match="MASTER_PORT must be a port number"):
        rendezvous_from_env({"MASTER_PORT": "x"})


# -------------------------------------------------------------- env service, several servers
def test_env_config_takes_comma_separated_inference_urls() -> None:
    cfg = EnvConfig(inference_url="http://a:1, http://b:2,")
    assert cfg.inference_urls() == ["http://a:1", "http://b:2"]
    assert EnvConfig().inference_urls() == ["http://127.0.0.1:9001"]  # settings/ports.py


def test_pool_picks_the_least_loaded_server_round_robin_on_ties() -> None:
    pool = InferencePool(["http://a:1", "http://b:2", "http://c:3"])
    assert [pool.pick() for _ in range(4)] == [0, 1, 2, 0]  # all idle: round-robin
    pool.in_flight = [2, 0, 1]
    assert pool.pick() == 1
    pool.in_flight = [1, 1, 0]
    assert pool.pick() == 2
    assert pool.base_url == "http://a:1,http://b:2,http://c:3"
    asyncio.run(pool.aclose())
    with pytest.raises(ValueError, match="at least one"):
        InferencePool([])


def test_trainer_and_env_args_pass_through_last(tmp_path: Path) -> None:
    """--trainer-args / --env-args are the last layer, so they win over the preset."""
    argv = ["--trainer-args=--lr 2e-4 --kl-coef 0.07", "--env-args=--group-size 6"]
    r = resolve_for_run(argv, "http://api:1", ["http://v:2"], tmp_path)
    grpo, env = r.trainer.grpo, r.env
    assert parse_args([]).trainer.grpo.lr == 1e-4  # the preset's
    assert grpo.lr == 2e-4 and grpo.kl_beta == 0.07  # ours (--kl-coef: Atropos')
    assert env.group_size == 6 and r.env_args == "--group-size 6"


def test_context_warning_when_rollouts_reach_past_the_sft_sequences(tmp_path: Path) -> None:
    """The launcher warns when prompt + completion budgets exceed what the SFT trained on."""
    import json

    env = _configs([], tmp_path).env  # the cpu-tiny preset's budgets
    budget = (env.max_prompt_tokens, env.max_tokens)
    assert context_warning(str(tmp_path), *budget) is None  # no SFT record: nothing to check
    (tmp_path / "trainer_config.json").write_text(json.dumps({"max_seq_len": 1024}))
    assert sum(budget) <= 1024
    assert context_warning(str(tmp_path), *budget) is None
    longer = (1536, env.max_tokens)
    warning = context_warning(str(tmp_path), *longer)
    assert warning is not None and "sequences of 1024 tokens" in warning and "1632" in warning
    (tmp_path / "trainer_config.json").write_text("{not json")
    assert context_warning(str(tmp_path), *longer) is None

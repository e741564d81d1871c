"""The ``launch:`` section of a run: launch/run_all.sh's own options, also taken without the
``launch.`` prefix (``--run-dir``; docs/RECIPES.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from launch.placement import num_servers_from_env
from settings.lists import CommaList
from settings.paths import TINY_MODEL_DIR


class LaunchConfig(BaseModel):
    """launch/run_all.sh's own options."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    build_embedded: bool = False
    """Build the base model, the dataset and the SFT cold start if missing."""
    base_model: str = str(TINY_MODEL_DIR)
    """build_embedded: the model SFT starts from."""
    build_module: str = "trainer.tiny_model"
    """build_embedded: `python -m` module that builds base_model if missing."""
    trainer_device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer runs (launch/placement.py picks the GPUs)."""
    cost_probe: bool = True
    """CPU trainer: before SFT and GRPO start, time one optimizer step of the phase's model
    at its shapes on this CPU and print what the phase will cost (launch/cost_probe.py);
    where the run would exceed ~90 min, print why and the cpu-tiny command, then do what
    ``long_run`` says. Phases of a few steps, or of steps of seconds (the tiny model), are not
    probed. False (``--no-cost-probe``): no probe."""
    long_run: Literal["warn", "tiny"] = "warn"
    """What a run the cost probe measures at over ~90 min of training does, before anything
    is trained: ``warn``: go on with the preset asked for (the user chose it); ``tiny``: run the
    cpu-tiny preset instead, in the same run directory, saying why (what ``make run`` asks:
    the real model where this CPU trains it in time, else the tiny one)."""
    fork_services: bool = True
    """CPU runs: start the Python services and steps (API, vLLM servers, Shop-R1 env,
    trainer, evaluations, dataset and SFT) as forks of one template process that imported
    vLLM, torch and transformers once (launch/forked.py), instead of each paying those
    imports (~10 CPU-s a vLLM server, ~8 a trainer). Runs with a GPU, torchrun trainers and
    verifiers services always start plainly. False (``--no-fork-services``): all plainly."""
    eval_samples: int = Field(512, ge=0)
    """Steps of the SFT-vs-RL evaluation, the split's first ones (0: skip); 512 gives ~±3
    points."""
    eval_server: Literal["auto", "own", "run"] = "auto"
    """Which vLLM server the SFT-vs-RL evaluations ask. ``own``: one of their own per
    evaluation, started with every core (nothing else computes meanwhile; the RL one loads
    the trainer's final model). ``run``: the run's first server with its share of the cores
    (the RL one answers with the weights the trainer synced last: the bridge end to end).
    ``auto``: ``own`` on the CPU from ``EVAL_OWN_SERVER_MIN`` steps on (where the faster
    answers pay for the server's start), else ``run`` (launch/evaluation.py)."""
    eval_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the evaluations' servers of their own (``eval_server``), the same for both so
    that RL - SFT stays paired. ``auto``: ``bfloat16`` where the trainer computes in bf16 on the
    CPU (``trainer.grpo.precision`` auto on a CPU with native bf16, trainer/precision.py): the
    precision the model was trained in, ~1.5x sooner than fp32 for SmolLM2
    (docs/results/eval_server.md); else the run's servers' dtype. A LoRA run evaluates on the
    run's server, in its dtype (launch/evaluation.py)."""
    eval_split: Literal["test", "validation"] = "test"
    """Split of the SFT-vs-RL evaluation: ``validation`` while choosing a run's settings (no
    test row is looked at), ``test`` for the run that reports them."""
    run_dir: Path | None = None
    """Run directory (default runs/<timestamp>)."""
    resume: bool = False
    """Continue the run in --run-dir (after a crash, an OOM kill, a full disk or Ctrl-C): the
    same API database, the trainer from its last checkpoint; the model, dataset and SFT
    checkpoint are reused (an unfinished SFT continues from its own checkpoint), and so is a
    finished SFT evaluation. Give the run's other flags again."""
    api_port: int | None = None
    """API port (default: a free one)."""
    vllm_port: int | None = None
    """Port of the first vLLM server (default: a free one; others: free)."""
    num_inference_servers: int = Field(default_factory=num_servers_from_env, ge=1)
    """vLLM servers to start, all synced by the trainer and sampled by the env (default:
    $NUM_INFERENCE_NODES as in Atropos, unset or 0 = 1)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM --tensor-parallel-size of each server (GPUs per server)."""
    trainer_procs: int = Field(1, ge=1)
    """Trainer processes on this node: >1 runs the trainer under torchrun, sharded with FSDP2
    (one GPU each on CUDA). Several nodes: set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
    (docs/MULTINODE.md)."""
    vllm_args: str | None = None
    """More vLLM flags for every server, one quoted string after '=' (e.g.
    --vllm-args='--gpu-memory-utilization 0.3'); they win over the run's ``vllm:`` section."""
    gpus: CommaList | None = None
    """GPU presets: the GPU ids (a list, or comma-separated) to place the servers and the trainer on (default:
    $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)."""
    prepare_only: bool = False
    """Build the tiny model, dataset and SFT checkpoint if missing, then exit."""
    health_timeout: float = 600.0
    """Seconds to wait for each health check."""
    shop_r1_env: bool = True
    """Start the Shop-R1 environment service. False: only the run's ``verifiers:``
    environment trains (docs/VERIFIERS.md); Shop-R1's dataset, SFT and evaluation are
    skipped (the preset's base model is still built if missing)."""
    verifiers_eval_env_args: str | None = None
    """JSON taskset fields of the ``verifiers:`` env's held-out evaluation (e.g.
    '{"split": "test"}'), run before and after training on the served weights; none: no
    evaluation."""
    verifiers_eval_samples: int = Field(8, ge=2)
    """Episodes per held-out task in that evaluation (at least 2: the before/after
    difference is taken task by task, with each task's sampling variance)."""

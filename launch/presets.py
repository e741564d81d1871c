"""Presets of launch/run_all.sh: which model, which devices, how big a rollout budget.

``cpu-tiny`` is the embedded default (tiny model, SFT cold start built on the spot). The GPU
presets name hub models; they need CUDA vLLM and a GPU machine and are not exercised in CI.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from launch.paths import SFT_MODEL_DIR


class Preset(BaseModel):
    """One named launch configuration."""

    model: str = Field(description="Model vLLM serves and the trainer starts from.")
    build_embedded: bool = Field(
        description="Build the tiny model, the dataset and the SFT cold start if missing."
    )
    trainer_device: str = Field(description="Trainer `--device` (`cpu`, `cuda:N`).")
    vllm_extra: list[str] = Field(
        default_factory=list, description="Extra flags for the vLLM server (dtype, GPU memory)."
    )
    group_size: int = Field(description="Completions per prompt (a GRPO group).")
    batch_groups: int = Field(description="Groups per trainer batch.")
    max_tokens: int = Field(description="Completion budget of a rollout, in tokens.")
    lr: float = Field(description="Trainer learning rate.")
    trainer_extra: list[str] = Field(
        default_factory=list,
        description="Extra `python -m trainer grpo` flags (GRPO settings beyond lr and batch).",
    )
    env_extra: list[str] = Field(
        default_factory=list,
        description="Extra `python -m env_server` flags (sampling, reward variant, ...).",
    )


PRESETS: dict[str, Preset] = {
    # lr 2e-4: the tiny model was trained from scratch at 2e-3 (SFT) and moved too little at
    # 5e-5 (docs/results/learning_cpu.md); 2 groups of 4 per step keep a step ~11 s on 2 cores,
    # so the default 40 steps fit the 30-minute budget of a fresh `launch/run_all.sh`.
    "cpu-tiny": Preset(
        model=str(SFT_MODEL_DIR),
        build_embedded=True,
        trainer_device="cpu",
        group_size=4,
        batch_groups=2,
        max_tokens=96,
        lr=2e-4,
    ),  # fmt: skip
    # On one GPU machine: vLLM on GPU 0, trainer on GPU 1 (broadcast); --single-copy puts both on
    # GPU 0 (CUDA IPC), the launcher handles that by overriding the trainer device.
    "gpu-0.5b": Preset(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        build_embedded=False,
        trainer_device="cuda:1",
        vllm_extra=["--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"],
        group_size=8,
        batch_groups=8,
        max_tokens=256,
        lr=1e-6,
    ),  # fmt: skip
    "gpu-3b": Preset(
        model="Qwen/Qwen2.5-3B-Instruct",
        build_embedded=False,
        trainer_device="cuda:1",
        vllm_extra=["--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"],
        group_size=8,
        batch_groups=8,
        max_tokens=256,
        lr=1e-6,
    ),  # fmt: skip
}

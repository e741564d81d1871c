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
    max_prompt_tokens: int = Field(
        description="Prompt budget of rollouts and of the SFT-vs-RL evaluation, in tokens; "
        "with max_tokens it must stay within the context the model was trained on."
    )
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
    # The settings of docs/results/learning_cpu.md's exp14/exp15: trained on the paper's
    # `no_dars` ablation (its terms and weights, the hard attribute's ROUGE-L at factor 1: with
    # DARS 1000 a right `terminate`, worth 0.8, is never worth keeping and the policy stopped
    # leaving the site; the evaluation still reports the paper's full reward), rollouts at
    # temperature 0.7 (at 1.0 the tiny model's sampled element names almost never hit),
    # Dr. GRPO advantages (centred, not divided by the group's std, which let groups differing
    # only by format credit push the policy onto `terminate`), 4 groups of 8 a step, lr 1e-4,
    # KL 0.05, 120 steps (run_all's --steps default), trainer precision `auto`: bf16 matmuls
    # (fp32 master weights; 1.5x faster steps, the same trainer/vLLM logprob mismatch) on a
    # CPU with native bf16, fp32 on one without (emulated bf16 is 30-180x slower there;
    # trainer/precision.py, docs/TRAINER.md).
    # Recipe twin: recipes/tiny-qwen2/shop-r1/grpo_no_dars.yaml.
    "cpu-tiny": Preset(
        model=str(SFT_MODEL_DIR),
        build_embedded=True,
        trainer_device="cpu",
        group_size=8,
        batch_groups=4,
        max_tokens=96,
        # + 96 = the 1024-token sequences the tiny model is SFT-trained on: a longer prompt
        # puts it on positions it never saw (env_server.config.DEFAULT_MAX_PROMPT_TOKENS)
        max_prompt_tokens=928,
        lr=1e-4,
        trainer_extra=[
            "--kl-beta",
            "0.05",
            "--temperature",
            "0.7",
            "--no-scale-advantages",
            "--precision",
            "auto",
        ],  # fmt: skip
        env_extra=["--temperature", "0.7", "--reward-variant", "no_dars"],
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
        max_prompt_tokens=3072,
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
        max_prompt_tokens=3072,
        lr=1e-6,
    ),  # fmt: skip
}

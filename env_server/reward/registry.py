"""The reward registry: named terms (``RewardTerm``) a recipe's ``rewards:`` section picks and
weights (docs/RECIPES.md), the paper's terms (Table 1) registered at import, and the ROUGE-L
similarity the attribute terms use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal


@dataclass
class ScoreContext:
    """What a reward term sees: the parsed prediction, the gold action and shared lookups."""

    pred: dict[str, str]
    gold: dict[str, str]
    type_match: bool
    exact_match: bool
    rouge_threshold: float
    rationale: str = ""
    _rouge: dict[str, float] = field(default_factory=dict)

    def rouge(self, key: str) -> float:
        """Raw ROUGE-L F of attribute ``key`` (``name``/``text``), computed once."""
        if key not in self._rouge:
            self._rouge[key] = rouge_l(self.pred.get(key, ""), self.gold.get(key, ""))
        return self._rouge[key]

    def similarity(self, key: str) -> float:
        """ROUGE-L F of ``key`` if it reaches the threshold, else 0 (no partial credit)."""
        sim = self.rouge(key)
        return sim if sim >= self.rouge_threshold else 0.0


@dataclass(frozen=True)
class RewardTerm:
    """A named entry of the reward registry.

    ``credit`` terms return a value in [0, 1] that is multiplied by their (normalized) weight
    and by the factor of the ``scale`` term named in ``scaled_by`` (if listed); ``scale`` terms
    (DARS) only provide that factor. Every term needs a well-formed completion: a format
    failure scores 0 whatever the recipe lists.
    """

    name: str
    kind: Literal["credit", "scale"]
    default: float
    """The paper's weight (credit) or factor (scale), Table 1."""
    description: str
    fn: Callable[[ScoreContext], float] | None = None
    slot: str | None = None
    """RewardBreakdown field the credit adds to (None: only in ``components``)."""
    scaled_by: str | None = None
    attribute: bool = False
    """Needs the predicted type to match (``attributes_require_type_match``)."""
    gold_type: str | None = None
    """Applies only when the gold action has this type."""


REGISTRY: dict[str, RewardTerm] = {}
"""Every reward term a recipe's ``rewards.components`` can name."""


def register(term: RewardTerm) -> RewardTerm:
    """Add a term (a project or a user module can add its own before the config is parsed)."""
    if term.name in REGISTRY:
        raise ValueError(f"reward term {term.name!r} is already registered")
    if term.kind == "credit" and term.fn is None:
        raise ValueError(f"credit term {term.name!r} needs a function")
    REGISTRY[term.name] = term
    return term


def _present(key: str) -> Callable[[ScoreContext], float]:
    return lambda c: 1.0 if c.pred.get(key) else 0.0


for _term in (
    RewardTerm(
        "format",
        "credit",
        0.5,
        "Well-formed completion (one JSON object, both keys).",
        lambda c: 1.0,
        slot="format",
    ),
    RewardTerm(
        "type",
        "credit",
        0.3,
        "Predicted action type == gold type.",
        lambda c: 1.0 if c.type_match else 0.0,
        slot="type",
    ),
    RewardTerm(
        "click_name",
        "credit",
        0.2,
        "click: a name is given.",
        _present("name"),
        slot="name",
        attribute=True,
        gold_type="click",
    ),
    RewardTerm(
        "click_name_rouge",
        "credit",
        1.0,
        "click: ROUGE-L(name) above the threshold (DARS-scaled).",
        lambda c: c.similarity("name"),
        slot="name_similarity",
        scaled_by="dars",
        attribute=True,
        gold_type="click",
    ),
    RewardTerm(
        "tas_name",
        "credit",
        0.1,
        "type_and_submit: a name is given.",
        _present("name"),
        slot="name",
        attribute=True,
        gold_type="type_and_submit",
    ),
    RewardTerm(
        "tas_text",
        "credit",
        0.1,
        "type_and_submit: a text is given.",
        _present("text"),
        slot="text",
        attribute=True,
        gold_type="type_and_submit",
    ),
    RewardTerm(
        "tas_name_rouge",
        "credit",
        0.1,
        "type_and_submit: ROUGE-L(name) above the threshold (not DARS-scaled).",
        lambda c: c.similarity("name"),
        slot="name_similarity",
        attribute=True,
        gold_type="type_and_submit",
    ),
    RewardTerm(
        "tas_text_rouge",
        "credit",
        1.0,
        "type_and_submit: ROUGE-L(text) above the threshold (DARS-scaled).",
        lambda c: c.similarity("text"),
        slot="text_similarity",
        scaled_by="dars",
        attribute=True,
        gold_type="type_and_submit",
    ),
    RewardTerm(
        "exact_match",
        "credit",
        1.0,
        "Exact action match (type + attributes, normalized): the binary reward.",
        lambda c: 1.0 if c.exact_match else 0.0,
        slot="exact",
    ),
    RewardTerm(
        "dars",
        "scale",
        1000.0,
        "Difficulty-aware reward scaling: factor on the hard attribute's ROUGE-L credit.",
    ),
):
    register(_term)

PAPER_COMPONENTS: dict[str, float] = {
    name: REGISTRY[name].default
    for name in (
        "format",
        "type",
        "click_name",
        "click_name_rouge",
        "tas_name",
        "tas_text",
        "tas_name_rouge",
        "tas_text_rouge",
        "dars",
    )
}
"""The paper's full reward (Table 1) as registry entries."""


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(pred: str, gold: str) -> float:
    """ROUGE-L F-measure (rouge-score's tokenizer: lowercase alphanumeric words)."""
    if not pred.strip() or not gold.strip():
        return 0.0
    return float(_scorer().score(gold, pred)["rougeL"].fmeasure)

"""Scoring one completion: ``score`` parses it (parse.py), runs every weighted registry term
(registry.py) of the configured reward (config.py) and returns a ``RewardBreakdown``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from env_server.actions import actions_equal, canonical_action
from env_server.reward.config import RewardConfig, RewardSpec
from env_server.reward.parse import FormatFailure, parse_output
from env_server.reward.registry import REGISTRY, ScoreContext


@dataclass
class RewardBreakdown:
    """The reward and its parts (each part is the credit it added to ``total``)."""

    total: float = 0.0
    format: float = 0.0
    type: float = 0.0
    name: float = 0.0
    """Name presence credit."""
    text: float = 0.0
    """Text presence credit."""
    name_similarity: float = 0.0
    text_similarity: float = 0.0
    exact: float = 0.0
    """Exact-match credit (the binary reward's only term)."""
    rouge_name: float = 0.0
    """Raw ROUGE-L F of the name (before threshold and weights)."""
    rouge_text: float = 0.0
    valid: bool = False
    type_match: bool = False
    exact_match: bool = False
    pred_type: str | None = None
    failure: str | None = None
    extras: dict[str, float] = field(default_factory=dict)
    components: dict[str, float] = field(default_factory=dict)
    """Credit of every listed registry entry, by name (0.0 when not earned); sums to total."""

    def metrics(self) -> dict[str, float]:
        """Numeric components, for the scored group's ``metrics``."""
        d = asdict(self)
        out = {k: float(v) for k, v in d.items() if isinstance(v, (int, float, bool))}
        return out | {f"extra_{k}": v for k, v in self.extras.items()}


_DEFAULT_SPEC = RewardSpec()
_SLOTS = ("format", "type", "name", "text", "name_similarity", "text_similarity", "exact")


def as_spec(config: RewardConfig | RewardSpec | None) -> RewardSpec:
    """Any accepted reward description as a :class:`RewardSpec` (None: the paper's)."""
    if config is None:
        return _DEFAULT_SPEC
    return config if isinstance(config, RewardSpec) else config.to_spec()


def score(
    text: str, gold_action: dict[str, Any], config: RewardConfig | RewardSpec | None = None
) -> RewardBreakdown:
    """Score one completion against the gold action. Pure; never raises on bad model output."""
    spec = as_spec(config)
    weights, scales = spec.weights, spec.scales
    gold = canonical_action(gold_action)
    parsed = parse_output(text)
    if isinstance(parsed, FormatFailure):
        return RewardBreakdown(failure=parsed.reason, components=dict.fromkeys(weights, 0.0))
    pred = parsed.action
    r = RewardBreakdown(valid=True, pred_type=pred["type"])
    r.type_match = pred["type"] == gold["type"]
    r.exact_match = actions_equal(pred, gold)
    ctx = ScoreContext(
        pred, gold, r.type_match, r.exact_match, spec.rouge_threshold, parsed.rationale
    )
    attributes_open = r.type_match or not spec.attributes_require_type_match
    custom = 0.0
    for name, weight in weights.items():
        term = REGISTRY[name]
        applies = (not term.attribute or attributes_open) and (
            term.gold_type is None or term.gold_type == gold["type"]
        )
        scale = scales.get(term.scaled_by, 1.0) if term.scaled_by else 1.0
        # weight x scale first: 1.0 x 1000 is exact, so DARS credit equals 1000 x sim exactly
        credit = (weight * scale) * term.fn(ctx) if applies else 0.0  # type: ignore[misc]
        r.components[name] = credit
        if term.slot in _SLOTS:
            setattr(r, term.slot, getattr(r, term.slot) + credit)
        else:
            custom += credit
    if attributes_open and any(REGISTRY[n].attribute for n in weights):
        if gold["type"] in ("click", "type_and_submit"):
            r.rouge_name = ctx.rouge("name")
        if gold["type"] == "type_and_submit":
            r.rouge_text = ctx.rouge("text")
    # Summed in the order of the original Table-1 code, so the paper's reward is bit-identical.
    r.total = r.format + r.type + r.name + r.text + r.name_similarity + r.text_similarity
    r.total += r.exact + custom
    return r

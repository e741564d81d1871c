"""Strict output parser and the Shop-R1 hierarchical reward (paper Table 1).

A completion is valid only if it is exactly one JSON object (surrounding whitespace allowed)
with exactly the keys ``rationale`` (non-empty string) and ``action``; ``action`` has a known
``type``, the attributes that type needs as non-empty strings, and no other keys (an attribute
the type does not use may appear only as ``""``). Anything else -- prose around the object,
code fences, two objects, duplicate keys, wrong types -- is a format failure, reported as a
value, never raised.

Reward (every constant in :class:`RewardConfig`):

    format      0.5   valid format; everything below needs it
    type        0.3   predicted type == gold type
    click:            +0.2 name present, + DARS x ROUGE-L(name)
    type_and_submit:  +0.1 name present, +0.1 text present,
                      +0.1 x ROUGE-L(name) + DARS x ROUGE-L(text)
    terminate:        nothing beyond format + type

Attribute credit needs the type to match (``attributes_require_type_match``); a ROUGE-L
similarity (``rouge-score``, F-measure) is credited only when it reaches ``rouge_threshold``.
DARS (difficulty-aware reward scaling) is ``dars_factor``. The paper's ablations are presets
(:meth:`RewardConfig.variant`): ``binary`` (1 for an exact action match, else 0),
``no_dars`` (DARS factor 1) and ``no_format`` (no format credit; validity still gates).

The rationale reward (self-certainty, alpha 0.005) needs the policy's full-vocabulary
distribution over the rationale tokens, which only the trainer has. The environment marks
those tokens (``spans.rationale`` in a scored group, from :func:`rationale_char_span`) and the
trainer adds ``alpha x mean_t KL(p_t || uniform)`` from its own logits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, Field

from env_server.actions import ACTION_TYPES, REQUIRED_KEYS, actions_equal, canonical_action

# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ParsedOutput:
    """A well-formed completion."""

    rationale: str
    action: dict[str, str]
    rationale_span: tuple[int, int]
    """Character offsets of the rationale string's content (between its quotes) in the text."""


@dataclass(frozen=True)
class FormatFailure:
    """Why a completion is not well-formed."""

    reason: str


_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


class _Malformed(Exception):
    pass


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _scan_object(s: str, i: int) -> tuple[list[tuple[str, Any, int, int]], int]:
    """Scan a JSON object at ``s[i]``: ``[(key, value, value_start, value_end)], end``.

    A small hand scanner (values still go through ``json``) so that duplicate keys are caught
    and the position of every value is known.
    """
    if i >= len(s) or s[i] != "{":
        raise _Malformed("output does not start with a JSON object")
    items: list[tuple[str, Any, int, int]] = []
    i = _skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return items, i + 1
    while True:
        if i >= len(s) or s[i] != '"':
            raise _Malformed("expected a quoted key")
        key, i = json.decoder.scanstring(s, i + 1)
        i = _skip_ws(s, i)
        if i >= len(s) or s[i] != ":":
            raise _Malformed(f"expected ':' after key {key!r}")
        start = _skip_ws(s, i + 1)
        value, end = _DECODER.raw_decode(s, start)
        items.append((key, value, start, end))
        i = _skip_ws(s, end)
        if i < len(s) and s[i] == ",":
            i = _skip_ws(s, i + 1)
            continue
        if i < len(s) and s[i] == "}":
            return items, i + 1
        raise _Malformed("expected ',' or '}' in the object")


def _check_unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise _Malformed(f"duplicate key(s) {dup}")
    return dict(pairs)


def _check_action(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _Malformed("'action' is not an object")
    kind = value.get("type")
    if kind not in ACTION_TYPES:
        raise _Malformed(f"action type {kind!r} is not one of {list(ACTION_TYPES)}")
    extra = sorted(set(value) - {"type", "name", "text"})
    if extra:
        raise _Malformed(f"unknown action key(s) {extra}")
    for key in ("name", "text"):
        v = value.get(key)
        if key in REQUIRED_KEYS[kind]:
            if not isinstance(v, str) or not v.strip():
                raise _Malformed(f"a {kind} action needs a non-empty string '{key}'")
        elif v not in (None, "") or (key in value and not isinstance(v, str)):
            raise _Malformed(f"a {kind} action takes no '{key}'")
    return canonical_action(value)


def parse_output(text: Any) -> ParsedOutput | FormatFailure:
    """Parse a completion strictly; never raises."""
    try:
        if not isinstance(text, str):
            raise _Malformed(f"output is {type(text).__name__}, not text")
        start = _skip_ws(text, 0)
        items, end = _scan_object(text, start)
        if _skip_ws(text, end) != len(text):
            raise _Malformed("text after the JSON object")
        obj = _check_unique([(k, v) for k, v, _, _ in items])
        if set(obj) != {"rationale", "action"}:
            raise _Malformed(f"keys must be exactly rationale and action, got {sorted(obj)}")
        rationale = obj["rationale"]
        if not isinstance(rationale, str) or not rationale.strip():
            raise _Malformed("'rationale' must be a non-empty string")
        action_pairs = _action_pairs(text, items)
        action = _check_action(_check_unique(action_pairs))
        r_start, r_end = next((s, e) for k, _, s, e in items if k == "rationale")
        return ParsedOutput(
            rationale=rationale, action=action, rationale_span=(r_start + 1, r_end - 1)
        )
    except (_Malformed, ValueError, RecursionError) as e:
        # json's own errors are ValueError subclasses; RecursionError on absurd nesting.
        return FormatFailure(reason=str(e) or type(e).__name__)


def _action_pairs(text: str, items: list[tuple[str, Any, int, int]]) -> list[tuple[str, Any]]:
    """The action object's (key, value) pairs, duplicates kept (re-scanned from the text)."""
    _, value, start, _ = next(it for it in items if it[0] == "action")
    if not isinstance(value, dict):
        raise _Malformed("'action' is not an object")
    inner, _ = _scan_object(text, start)
    return [(k, v) for k, v, _, _ in inner]


def rationale_char_span(text: str) -> tuple[int, int] | None:
    """Character span of the rationale's content in a well-formed completion, else None."""
    parsed = parse_output(text)
    return parsed.rationale_span if isinstance(parsed, ParsedOutput) else None


# ----------------------------------------------------------------------------- reward


class RewardConfig(BaseModel):
    """Constants of the hierarchical reward; defaults are the paper's (Table 1)."""

    mode: Literal["hierarchical", "binary"] = Field(
        "hierarchical", description="'binary': 1 for an exact action match, else 0 (ablation)."
    )
    format_reward: float = Field(0.5, description="Credit for a well-formed completion.")
    type_reward: float = Field(0.3, description="Credit for the right action type.")
    click_name_presence: float = Field(0.2, description="click: credit for giving a name.")
    tas_name_presence: float = Field(0.1, description="type_and_submit: credit for a name.")
    tas_text_presence: float = Field(0.1, description="type_and_submit: credit for a text.")
    tas_name_similarity: float = Field(
        0.1, description="type_and_submit: weight of ROUGE-L(name) (not DARS-scaled)."
    )
    dars_factor: float = Field(
        1000.0, description="Difficulty-aware scaling of the hard attribute's ROUGE-L credit."
    )
    rouge_threshold: float = Field(
        0.75, description="ROUGE-L F below this earns no similarity credit."
    )
    attributes_require_type_match: bool = Field(
        True, description="Give attribute credit only when the predicted type is right."
    )

    @classmethod
    def variant(cls, name: str) -> RewardConfig:
        """Presets: 'full' (paper), 'binary', 'no_dars', 'no_format' (paper ablations)."""
        presets: dict[str, dict[str, Any]] = {
            "full": {},
            "binary": {"mode": "binary"},
            "no_dars": {"dars_factor": 1.0},
            "no_format": {"format_reward": 0.0},
        }
        if name not in presets:
            raise ValueError(f"unknown reward variant {name!r}; expected one of {list(presets)}")
        return cls(**presets[name])


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
    rouge_name: float = 0.0
    """Raw ROUGE-L F of the name (before threshold and weights)."""
    rouge_text: float = 0.0
    valid: bool = False
    type_match: bool = False
    exact_match: bool = False
    pred_type: str | None = None
    failure: str | None = None
    extras: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Numeric components, for the scored group's ``metrics``."""
        d = asdict(self)
        out = {k: float(v) for k, v in d.items() if isinstance(v, (int, float, bool))}
        return out | {f"extra_{k}": v for k, v in self.extras.items()}


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(pred: str, gold: str) -> float:
    """ROUGE-L F-measure (rouge-score's tokenizer: lowercase alphanumeric words)."""
    if not pred.strip() or not gold.strip():
        return 0.0
    return float(_scorer().score(gold, pred)["rougeL"].fmeasure)


def _credit(sim: float, weight: float, cfg: RewardConfig) -> float:
    return weight * sim if sim >= cfg.rouge_threshold else 0.0


def score(
    text: str, gold_action: dict[str, Any], config: RewardConfig | None = None
) -> RewardBreakdown:
    """Score one completion against the gold action. Pure; never raises on bad model output."""
    cfg = config or RewardConfig()
    gold = canonical_action(gold_action)
    parsed = parse_output(text)
    if isinstance(parsed, FormatFailure):
        return RewardBreakdown(failure=parsed.reason)
    pred = parsed.action
    r = RewardBreakdown(valid=True, pred_type=pred["type"], format=cfg.format_reward)
    r.type_match = pred["type"] == gold["type"]
    r.exact_match = actions_equal(pred, gold)
    if cfg.mode == "binary":
        r.total = 1.0 if r.exact_match else 0.0
        return r
    if r.type_match:
        r.type = cfg.type_reward
    if r.type_match or not cfg.attributes_require_type_match:
        _attribute_credit(r, pred, gold, cfg)
    r.total = r.format + r.type + r.name + r.text + r.name_similarity + r.text_similarity
    return r


def _attribute_credit(
    r: RewardBreakdown, pred: dict[str, str], gold: dict[str, str], cfg: RewardConfig
) -> None:
    name, text = pred.get("name", ""), pred.get("text", "")
    if gold["type"] == "click":
        r.name = cfg.click_name_presence if name else 0.0
        r.rouge_name = rouge_l(name, gold["name"])
        r.name_similarity = _credit(r.rouge_name, cfg.dars_factor, cfg)
    elif gold["type"] == "type_and_submit":
        r.name = cfg.tas_name_presence if name else 0.0
        r.text = cfg.tas_text_presence if text else 0.0
        r.rouge_name = rouge_l(name, gold["name"])
        r.rouge_text = rouge_l(text, gold["text"])
        r.name_similarity = _credit(r.rouge_name, cfg.tas_name_similarity, cfg)
        r.text_similarity = _credit(r.rouge_text, cfg.dars_factor, cfg)

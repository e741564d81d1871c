"""Strict output parser and the Shop-R1 hierarchical reward (paper Table 1).

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

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

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


_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
"""Control characters (tab/newline/CR allowed) and lone surrogates (a ``\\ud800`` escape)."""


def _text_problem(v: Any) -> str | None:
    """Why ``v`` is not usable text (a non-empty string with something visible), or None."""
    if not isinstance(v, str):
        return f"got {type(v).__name__}"
    if not any(c.isprintable() and not c.isspace() for c in v):
        return "empty or only invisible characters"
    bad = _BAD_CHARS.search(v)
    if bad:
        return f"contains control/invalid character U+{ord(bad.group()):04X}"
    return None


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
            if problem := _text_problem(v):
                raise _Malformed(f"a {kind} action needs a non-empty string '{key}' ({problem})")
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
        if problem := _text_problem(rationale):
            raise _Malformed(f"'rationale' must be a non-empty string ({problem})")
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


# ----------------------------------------------------------------------------- registry


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
    RewardTerm("format", "credit", 0.5, "Well-formed completion (one JSON object, both keys).",
               lambda c: 1.0, slot="format"),
    RewardTerm("type", "credit", 0.3, "Predicted action type == gold type.",
               lambda c: 1.0 if c.type_match else 0.0, slot="type"),
    RewardTerm("click_name", "credit", 0.2, "click: a name is given.", _present("name"),
               slot="name", attribute=True, gold_type="click"),
    RewardTerm("click_name_rouge", "credit", 1.0,
               "click: ROUGE-L(name) above the threshold (DARS-scaled).",
               lambda c: c.similarity("name"), slot="name_similarity", scaled_by="dars",
               attribute=True, gold_type="click"),
    RewardTerm("tas_name", "credit", 0.1, "type_and_submit: a name is given.", _present("name"),
               slot="name", attribute=True, gold_type="type_and_submit"),
    RewardTerm("tas_text", "credit", 0.1, "type_and_submit: a text is given.", _present("text"),
               slot="text", attribute=True, gold_type="type_and_submit"),
    RewardTerm("tas_name_rouge", "credit", 0.1,
               "type_and_submit: ROUGE-L(name) above the threshold (not DARS-scaled).",
               lambda c: c.similarity("name"), slot="name_similarity", attribute=True,
               gold_type="type_and_submit"),
    RewardTerm("tas_text_rouge", "credit", 1.0,
               "type_and_submit: ROUGE-L(text) above the threshold (DARS-scaled).",
               lambda c: c.similarity("text"), slot="text_similarity", scaled_by="dars",
               attribute=True, gold_type="type_and_submit"),
    RewardTerm("exact_match", "credit", 1.0,
               "Exact action match (type + attributes, normalized): the binary reward.",
               lambda c: 1.0 if c.exact_match else 0.0, slot="exact"),
    RewardTerm("dars", "scale", 1000.0,
               "Difficulty-aware reward scaling: factor on the hard attribute's ROUGE-L credit."),
):  # fmt: skip
    register(_term)

PAPER_COMPONENTS: dict[str, float] = {
    name: REGISTRY[name].default
    for name in ("format", "type", "click_name", "click_name_rouge", "tas_name", "tas_text",
                 "tas_name_rouge", "tas_text_rouge", "dars")
}  # fmt: skip
"""The paper's full reward (Table 1) as registry entries."""


class RewardSpec(BaseModel):
    """A reward as registry entries with weights (a recipe's ``rewards:`` section).

    Normalization (``normalize: true``): the credit weights are rescaled by one factor so they
    sum to the sum of the *registry defaults (the paper's weights) of the same entries*. Listing
    the paper's entries with the paper's weights therefore changes nothing; dropping an entry
    (an ablation) leaves the others at the paper's values; giving relative weights (e.g. all 1)
    spreads the same budget over the listed entries. Scale entries (``dars``) are factors, never
    normalized; leaving ``dars`` out means no DARS (factor 1).
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    components: dict[str, float] = Field(default_factory=lambda: dict(PAPER_COMPONENTS))
    """Registry entry -> weight (credit entries) or factor (scale entries such as ``dars``)."""
    normalize: bool = True
    """Rescale the credit weights to the paper's budget of the listed entries (see above)."""
    rouge_threshold: float = Field(0.75, ge=0.0, le=1.0)
    """ROUGE-L F below this earns no similarity credit."""
    attributes_require_type_match: bool = True
    """Give attribute credit only when the predicted type is right."""

    _weights: dict[str, float] = PrivateAttr(default_factory=dict)
    _scales: dict[str, float] = PrivateAttr(default_factory=dict)

    @field_validator("components")
    @classmethod
    def _known(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(REGISTRY))
        if unknown:
            raise ValueError(
                f"unknown reward component(s) {unknown}; registered: {sorted(REGISTRY)}"
            )
        bad = [k for k, w in v.items() if not math.isfinite(w) or w < 0]
        if bad:
            raise ValueError(f"reward weights must be finite and >= 0: {bad}")
        if not any(REGISTRY[k].kind == "credit" for k in v):
            raise ValueError("a reward needs at least one credit component")
        return v

    def model_post_init(self, _context: Any) -> None:
        credits = {k: w for k, w in self.components.items() if REGISTRY[k].kind == "credit"}
        self._scales = {k: w for k, w in self.components.items() if REGISTRY[k].kind == "scale"}
        factor = 1.0
        if self.normalize:
            given = sum(credits.values())
            budget = sum(REGISTRY[k].default for k in credits)
            if given <= 0:
                raise ValueError("reward weights sum to 0; nothing to normalize")
            factor = budget / given  # exactly 1.0 for the paper's weights: same sums, same order
        self._weights = {k: w * factor if factor != 1.0 else w for k, w in credits.items()}

    @property
    def weights(self) -> dict[str, float]:
        """Effective credit weights after normalization."""
        return dict(self._weights)

    @property
    def scales(self) -> dict[str, float]:
        return dict(self._scales)


# ----------------------------------------------------------------------------- reward


class RewardConfig(BaseModel):
    """Constants of the hierarchical reward; defaults are the paper's (Table 1).

    The original flat form, kept for code and recipes that use it: it is turned into a
    :class:`RewardSpec` with these constants as absolute weights (:meth:`to_spec`).
    """

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
        """Presets: 'full' (paper), 'binary', 'no_dars', 'no_format' (paper ablations).

        The same ablations ship as recipes (``recipes/tiny-qwen2/shop-r1/grpo_<name>.yaml``,
        registry entries, no code path); tests check both score alike.
        """
        presets: dict[str, dict[str, Any]] = {
            "full": {},
            "binary": {"mode": "binary"},
            "no_dars": {"dars_factor": 1.0},
            "no_format": {"format_reward": 0.0},
        }
        if name not in presets:
            raise ValueError(f"unknown reward variant {name!r}; expected one of {list(presets)}")
        return cls(**presets[name])

    def to_spec(self) -> RewardSpec:
        """The same reward as registry entries (absolute weights: no normalization)."""
        if self.mode == "binary":
            components = {"exact_match": 1.0}
        else:
            components = {
                "format": self.format_reward, "type": self.type_reward,
                "click_name": self.click_name_presence, "click_name_rouge": 1.0,
                "tas_name": self.tas_name_presence, "tas_text": self.tas_text_presence,
                "tas_name_rouge": self.tas_name_similarity, "tas_text_rouge": 1.0,
                "dars": self.dars_factor,
            }  # fmt: skip
        return RewardSpec(
            components=components, normalize=False, rouge_threshold=self.rouge_threshold,
            attributes_require_type_match=self.attributes_require_type_match,
        )  # fmt: skip


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


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(pred: str, gold: str) -> float:
    """ROUGE-L F-measure (rouge-score's tokenizer: lowercase alphanumeric words)."""
    if not pred.strip() or not gold.strip():
        return 0.0
    return float(_scorer().score(gold, pred)["rougeL"].fmeasure)


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

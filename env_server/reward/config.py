"""How a reward is configured: ``RewardSpec`` (registry entries with weights, a recipe's
``rewards:`` section, docs/RECIPES.md) and the older flat ``RewardConfig`` (the paper's
constants and its ablation presets), which maps onto a ``RewardSpec``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from env_server.reward.registry import PAPER_COMPONENTS, REGISTRY


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
                "format": self.format_reward,
                "type": self.type_reward,
                "click_name": self.click_name_presence,
                "click_name_rouge": 1.0,
                "tas_name": self.tas_name_presence,
                "tas_text": self.tas_text_presence,
                "tas_name_rouge": self.tas_name_similarity,
                "tas_text_rouge": 1.0,
                "dars": self.dars_factor,
            }
        return RewardSpec(
            components=components,
            normalize=False,
            rouge_threshold=self.rouge_threshold,
            attributes_require_type_match=self.attributes_require_type_match,
        )

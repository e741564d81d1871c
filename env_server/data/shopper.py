"""The simulated shopper (env_server/data/simulator.py): who they are (``Shopper``: intent and
temperament, ``make_shopper``, ``make_query``), where they are (``State``), and the session
they leave behind (``Step``, ``Session``), which env_server/data/dataset.py turns into rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from env_server.data.catalog import CATEGORIES, Category, Product


@dataclass
class Step:
    """One decision: the page the shopper saw, what they did and why."""

    page: str
    action: dict[str, str]
    rationale: str
    alternatives: list[tuple[str, float]]
    """(action JSON, probability) of every plausible action at this step; the gold one included."""


@dataclass
class Session:
    session_id: str
    persona: str
    steps: list[Step]


@dataclass
class Shopper:
    """Intent and temperament; everything the policy needs to decide."""

    category: Category
    wants: tuple[str, ...]
    budget: float
    decisiveness: float
    patience: float
    persona: str

    def fit(self, p: Product) -> float:
        """How well a product matches the intent, in [0, 1]."""
        if p.category != self.category.key:
            return 0.05
        feat = sum(1 for w in self.wants if w in p.features) / max(1, len(self.wants))
        price = 1.0 if p.price <= self.budget else max(0.0, 1.0 - (p.price / self.budget - 1.0) * 2)
        return 0.15 + 0.85 * (0.4 + 0.6 * feat) * price * (0.6 + 0.4 * (p.rating - 2.5) / 2.5)


@dataclass
class State:
    """Where the shopper is and what they have seen."""

    kind: str = "home"
    query: str = ""
    results: list[Product] = field(default_factory=list)
    page_no: int = 1
    max_price: float | None = None
    sort: str = "relevance"
    product: Product | None = None
    option: str | None = None
    cart: list[Product] = field(default_factory=list)
    featured: list[Product] = field(default_factory=list)
    step: int = 0


_PERSONAS = (
    "a budget-conscious student",
    "a busy parent shopping on a lunch break",
    "a careful researcher who reads reviews",
    "an impulsive buyer",
    "a gift shopper",
    "a first-time buyer of this kind of product",
)


def make_shopper(rng: random.Random) -> Shopper:
    cat = rng.choice(CATEGORIES)
    lo, hi = cat.price_range
    return Shopper(
        category=cat,
        wants=tuple(rng.sample(cat.features, k=rng.choice((1, 1, 2)))),
        budget=round(lo + (hi - lo) * rng.uniform(0.2, 0.9), 0),
        decisiveness=rng.uniform(0.2, 0.9),
        patience=rng.uniform(1.5, 5.0),
        persona=rng.choice(_PERSONAS),
    )


def make_query(shopper: Shopper, rng: random.Random, previous: str = "") -> str:
    """A search query; a refinement adds a wanted feature or swaps the product word."""
    noun = rng.choice(shopper.category.nouns)
    if previous:
        missing = [w for w in shopper.wants if w not in previous]
        if missing and rng.random() < 0.7:
            return f"{missing[0]} {previous}"
        return f"{' '.join(shopper.wants[:1])} {noun}".strip()
    style = rng.random()
    if style < 0.35:
        return noun
    if style < 0.75:
        return f"{' '.join(shopper.wants)} {noun}"
    if style < 0.9:
        return f"{noun} under {int(shopper.budget)}"
    return f"{rng.choice(shopper.category.brands).lower()} {noun}"

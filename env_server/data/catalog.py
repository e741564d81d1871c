"""A seeded product catalogue and a small search engine over it.

Brands are invented. Every product title carries a model code, so titles (and the element
names derived from them) are unique within the catalogue.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Category:
    """A kind of product: the words people search with and what varies between items."""

    key: str
    nouns: tuple[str, ...]
    brands: tuple[str, ...]
    features: tuple[str, ...]
    price_range: tuple[float, float]
    option_name: str
    options: tuple[str, ...]


CATEGORIES: tuple[Category, ...] = (
    Category(
        "headphones",
        ("headphones", "earbuds", "headset"),
        ("Sonora", "Bassline", "Auralis", "Kestrel"),
        ("wireless", "noise cancelling", "over-ear", "bluetooth", "sport", "studio"),
        (15, 350),
        "color",
        ("black", "white", "navy"),
    ),
    Category(
        "coffee",
        ("coffee maker", "espresso machine", "french press"),
        ("Brewster", "Morningside", "Caffa"),
        ("programmable", "12-cup", "stainless steel", "single serve", "thermal carafe"),
        (20, 400),
        "color",
        ("black", "silver", "red"),
    ),
    Category(
        "shoes",
        ("running shoes", "trail shoes", "sneakers"),
        ("Stride", "Pacer", "Northpeak", "Velo"),
        ("lightweight", "waterproof", "cushioned", "wide fit", "breathable"),
        (40, 180),
        "size",
        ("7", "8", "9", "10", "11"),
    ),
    Category(
        "backpack",
        ("backpack", "laptop backpack", "daypack"),
        ("Trailhand", "Urbanite", "Packwell"),
        ("waterproof", "anti-theft", "17 inch", "lightweight", "rolling"),
        (20, 160),
        "color",
        ("grey", "black", "olive"),
    ),
    Category(
        "lamp",
        ("desk lamp", "floor lamp", "reading light"),
        ("Lumio", "Brightway", "Halden"),
        ("led", "dimmable", "usb charging", "adjustable", "warm white"),
        (15, 120),
        "finish",
        ("black", "white", "brass"),
    ),
    Category(
        "yoga",
        ("yoga mat", "exercise mat", "yoga block"),
        ("Zenfold", "Asana Co", "Flowline"),
        ("non-slip", "extra thick", "eco friendly", "foldable", "cork"),
        (10, 90),
        "color",
        ("purple", "teal", "charcoal"),
    ),
    Category(
        "bottle",
        ("water bottle", "tumbler", "thermos"),
        ("Hydrow", "Coolstone", "Sipwell"),
        ("insulated", "32 oz", "leak proof", "bpa free", "with straw"),
        (8, 50),
        "color",
        ("blue", "pink", "black", "green"),
    ),
    Category(
        "phonecase",
        ("phone case", "iphone case", "galaxy case"),
        ("Shellguard", "Armorline", "Slimfit"),
        ("clear", "shockproof", "magsafe", "wallet", "slim"),
        (8, 60),
        "color",
        ("clear", "black", "blue"),
    ),
    Category(
        "blender",
        ("blender", "smoothie blender", "hand blender"),
        ("Vortexa", "Whirlpro", "Kitchenly"),
        ("high speed", "portable", "1000 watt", "glass jar", "quiet"),
        (25, 300),
        "color",
        ("black", "silver"),
    ),
    Category(
        "chair",
        ("office chair", "gaming chair", "desk chair"),
        ("Sitwell", "Ergon", "Posturepro"),
        ("ergonomic", "mesh", "lumbar support", "reclining", "armless"),
        (60, 450),
        "color",
        ("black", "grey", "white"),
    ),
    Category(
        "tshirt",
        ("t-shirt", "graphic tee", "polo shirt"),
        ("Cottonwood", "Basicly", "Threadly"),
        ("cotton", "slim fit", "v-neck", "moisture wicking", "pack of 3"),
        (8, 45),
        "size",
        ("s", "m", "l", "xl"),
    ),
    Category(
        "skincare",
        ("moisturizer", "face serum", "sunscreen"),
        ("Dewlab", "Purely", "Glowen"),
        ("fragrance free", "spf 50", "hyaluronic", "vitamin c", "for sensitive skin"),
        (9, 70),
        "size",
        ("1 oz", "1.7 oz", "3.4 oz"),
    ),
    Category(
        "games",
        ("board game", "card game", "puzzle"),
        ("Meeple", "Tabletop House", "Riddlebox"),
        ("family", "strategy", "2 player", "party", "1000 piece"),
        (10, 80),
        "edition",
        ("standard", "deluxe"),
    ),
    Category(
        "knives",
        ("knife set", "chef knife", "paring knife"),
        ("Edgecraft", "Sharpline", "Kuro"),
        ("stainless steel", "german steel", "with block", "8 inch", "ceramic"),
        (15, 250),
        "handle",
        ("black", "wood"),
    ),
)

_POSITIVE = (
    "Works great, exactly as described.",
    "Really happy with this purchase.",
    "Good quality for the price.",
    "Arrived fast and feels well made.",
    "Would buy again.",
)
_NEGATIVE = (
    "Stopped working after two weeks.",
    "Cheaper feel than the photos suggest.",
    "Not worth the price.",
    "Runs small and the return was a hassle.",
    "Smaller than I expected.",
)


@dataclass(frozen=True)
class Product:
    """One catalogue item."""

    pid: str
    category: str
    brand: str
    noun: str
    features: tuple[str, ...]
    title: str
    price: float
    rating: float
    reviews: int
    review_texts: tuple[str, ...]
    options: tuple[str, ...]
    option_name: str

    @cached_property
    def slug(self) -> str:
        return slugify(self.title)

    @cached_property
    def title_words(self) -> list[str]:
        return _words(self.title)


@dataclass
class Catalog:
    """Products grouped by category, plus a word -> category index for search."""

    products: list[Product]
    by_category: dict[str, list[Product]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for p in self.products:
            self.by_category.setdefault(p.category, []).append(p)


def slugify(text: str, max_words: int = 6) -> str:
    """Element-name form of a title: 'Sonora X210 Wireless ...' -> 'sonora_x210_wireless...'."""
    words = re.sub(r"[^a-z0-9]+", " ", text.lower()).split()
    return "_".join(words[:max_words])


def build_catalog(rng: random.Random, per_category: int = 24) -> Catalog:
    """Make ``per_category`` products for every category (deterministic for a seeded rng)."""
    products: list[Product] = []
    for cat in CATEGORIES:
        codes = rng.sample(range(100, 1000), per_category)
        for i, code in enumerate(codes):
            brand = rng.choice(cat.brands)
            noun = cat.nouns[i % len(cat.nouns)]
            feats = tuple(rng.sample(cat.features, k=rng.choice((1, 2, 2, 3))))
            letter = "ABCDEFGHJKLMNPRSTVXZ"[code % 20]
            title = f"{brand} {letter}{code} {' '.join(f.title() for f in feats)} {noun.title()}"
            lo, hi = cat.price_range
            price = round(lo + (hi - lo) * rng.random() ** 1.6, 0) - 0.01
            rating = round(min(5.0, max(2.5, rng.gauss(4.2, 0.45))), 1)
            good = _POSITIVE if rating >= 4.0 else _NEGATIVE
            review_texts = (rng.choice(good), rng.choice(_POSITIVE + _NEGATIVE))
            products.append(
                Product(
                    pid=f"{cat.key}-{code}",
                    category=cat.key,
                    brand=brand,
                    noun=noun,
                    features=feats,
                    title=title,
                    price=max(price, 4.99),
                    rating=rating,
                    reviews=int(rng.lognormvariate(5.0, 1.3)) + 3,
                    review_texts=review_texts,
                    options=tuple(rng.sample(cat.options, k=min(len(cat.options), 3))),
                    option_name=cat.option_name,
                )
            )
    return Catalog(products)


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def search(
    catalog: Catalog, query: str, max_price: float | None = None, sort: str = "relevance"
) -> list[Product]:
    """Products whose category or title matches ``query``, best first.

    The score is word overlap between the query and the title (categories match through their
    nouns), with ratings breaking ties -- crude, like a small shop's search box.
    """
    q = _words(query)
    if not q:
        return []
    hits: list[tuple[float, str, Product]] = []
    for cat in CATEGORIES:
        cat_words = [w for n in cat.nouns for w in _words(n)]
        cat_hit = any(w in cat_words for w in q)
        for p in catalog.by_category.get(cat.key, []):
            overlap = sum(1 for w in q if w in p.title_words)
            if not cat_hit and overlap == 0:
                continue
            if max_price is not None and p.price > max_price:
                continue
            score = overlap + (1.0 if cat_hit else 0.0) + p.rating / 10.0
            hits.append((score, p.pid, p))
    if sort == "price":
        hits.sort(key=lambda h: (h[2].price, h[1]))
    elif sort == "rating":
        hits.sort(key=lambda h: (-h[2].rating, h[1]))
    else:
        hits.sort(key=lambda h: (-h[0], h[1]))
    return [h[2] for h in hits]

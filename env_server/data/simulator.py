"""Offline simulator of online-shopping sessions (the default Shop-R1 training data).

A shopper with an intent (a kind of product, wanted features, a budget) and a temperament
(how decisive, how patient) starts on the home page and moves through search results,
refinements, product pages, the cart and checkout, and ends by closing the tab
(``terminate``). At every step the shopper's policy gives several plausible next actions with
probabilities; the gold action is drawn from it, so even a perfect model cannot score 100%
(each step records the distribution in ``alternatives``, which bounds the reachable accuracy).
Every step has the page's simplified HTML, the gold action and a first-person rationale.

The shopper and the session's records are in shopper.py, the rationales in rationales.py.
Sessions are deterministic in ``(seed, index)``: session ``i`` is the same whatever
``num_sessions`` is, so a smaller set is a prefix of a larger one.
"""

from __future__ import annotations

import random
from typing import Any

from env_server.actions import action_to_json
from env_server.data import pages
from env_server.data.catalog import CATEGORIES, Catalog, Product, build_catalog, search
from env_server.data.rationales import rationale_for
from env_server.data.shopper import Session, Shopper, State, Step, make_query, make_shopper

MAX_STEPS = 14
"""Hard cap on a session's length (the shopper's patience usually ends it much earlier)."""


# ----------------------------------------------------------------------------- the policy


Weighted = list[tuple[dict[str, str], float]]
SEARCH_INPUT = {"type": "type_and_submit", "name": "search_input"}
BASE_QUIT = {
    "home": 0.06,
    "results": 0.2,
    "product": 0.22,
    "cart": 0.3,
    "checkout": 0.3,
    "confirmation": 0.9,
}
"""Weight of leaving the site on each page, before the shopper tires."""


def candidates(s: State, sh: Shopper, rng: random.Random) -> Weighted:
    """Plausible next actions with unnormalised weights, for the page the shopper is on."""
    on_page = {
        "home": _home_candidates,
        "results": _results_candidates,
        "product": _product_candidates,
        "cart": _cart_candidates,
        "checkout": _checkout_candidates,
        "confirmation": lambda s, sh, rng: (
            [({"type": "click", "name": "continue_shopping"}, 0.1)],
            0.0,
        ),
    }
    out, extra_quit = on_page[s.kind](s, sh, rng)
    fatigue = 1.0 + (s.step / sh.patience) ** 2  # patience runs out quadratically
    out.append(({"type": "terminate"}, (BASE_QUIT[s.kind] + extra_quit) * fatigue))
    return out


def _home_candidates(s: State, sh: Shopper, rng: random.Random) -> tuple[Weighted, float]:
    out: Weighted = [({**SEARCH_INPUT, "text": make_query(sh, rng)}, 0.8)]
    if sh.category in CATEGORIES[:8]:  # the nav bar shows the first eight categories
        out.append(({"type": "click", "name": f"nav_{sh.category.key}"}, 0.08))
    for p in s.featured:
        out.append(({"type": "click", "name": f"deal_{p.slug}"}, 0.15 * sh.fit(p) ** 2))
    return out, 0.0


def _results_candidates(s: State, sh: Shopper, rng: random.Random) -> tuple[Weighted, float]:
    shown = _shown(s)
    best = max((sh.fit(p) for p in shown), default=0.0)
    out: Weighted = [
        ({"type": "click", "name": f"product_{p.slug}"}, 0.45 * sh.fit(p) ** 2) for p in shown
    ]
    # Poor results make refining (or leaving, or paging on) more likely.
    out.append(({**SEARCH_INPUT, "text": make_query(sh, rng, s.query)}, 0.25 + 0.35 * (1 - best)))
    if s.max_price is None and any(p.price > sh.budget for p in shown):
        cap = min((c for c in pages.PRICE_FILTERS if c >= sh.budget), default=None)
        if cap is not None:
            out.append(({"type": "click", "name": f"filter_under_{cap}"}, 0.08))
    if s.sort == "relevance" and shown:
        out.append(({"type": "click", "name": "sort_by_rating"}, 0.03))
    if len(s.results) > s.page_no * pages.PAGE_SIZE:
        out.append(({"type": "click", "name": "next_page"}, 0.04 + 0.1 * (1 - best)))
    return out, 0.3 * (1 - best)


def _cart_candidates(s: State, sh: Shopper, rng: random.Random) -> tuple[Weighted, float]:
    out: Weighted = [
        ({"type": "click", "name": "proceed_to_checkout"}, 0.3 + 0.4 * sh.decisiveness),
        ({"type": "click", "name": "continue_shopping"}, 0.08),
    ]
    out += [({"type": "click", "name": f"remove_{p.slug}"}, 0.05) for p in s.cart[:1]]
    return out, 0.0


def _checkout_candidates(s: State, sh: Shopper, rng: random.Random) -> tuple[Weighted, float]:
    return [
        ({"type": "click", "name": "place_order"}, 0.4 + 0.5 * sh.decisiveness),
        ({"type": "click", "name": "back_to_cart"}, 0.05),
        ({"type": "type_and_submit", "name": "promo_code", "text": "SAVE10"}, 0.04),
    ], 0.0


def _product_candidates(s: State, sh: Shopper, rng: random.Random) -> tuple[Weighted, float]:
    p = s.product
    assert p is not None
    fit = sh.fit(p)
    out = [
        ({"type": "click", "name": "add_to_cart"}, 0.05 + 0.45 * fit * sh.decisiveness),
        ({"type": "click", "name": "buy_now"}, 0.1 * fit * sh.decisiveness),
        ({"type": "click", "name": "back_to_results"}, 0.1 + 0.2 * (1 - fit)),
        (
            {"type": "type_and_submit", "name": "search_input", "text": sh.category.nouns[0]},
            0.12 + 0.3 * (1 - fit),
        ),
    ]
    if s.option is None:
        out.append(({"type": "click", "name": pages.option_name(p, p.options[0])}, 0.08 * fit))
    return out, 0.2 * (1 - fit)


def _shown(s: State) -> list[Product]:
    start = (s.page_no - 1) * pages.PAGE_SIZE
    return s.results[start : start + pages.PAGE_SIZE]


# ----------------------------------------------------------------------------- the shop


def apply(s: State, action: dict[str, str], catalog: Catalog) -> State:
    """The page the shop shows after ``action`` (the shop itself is deterministic)."""
    name = action.get("name", "")
    by_slug = {p.slug: p for p in s.results + s.featured + s.cart}
    if s.product is not None:
        by_slug[s.product.slug] = s.product
    n = State(cart=list(s.cart), featured=s.featured, step=s.step + 1)
    if action["type"] == "type_and_submit" and name == "search_input":
        return _results(n, catalog, action["text"], None, "relevance")
    if name.startswith("nav_"):
        return _results(n, catalog, _cat_noun(name[4:]), None, "relevance")
    keep = {"query": s.query, "results": s.results, "page_no": s.page_no}
    keep |= {"max_price": s.max_price, "sort": s.sort}
    if name.startswith("filter_under_"):
        return _results(n, catalog, s.query, float(name.rsplit("_", 1)[1]), s.sort)
    if name.startswith("sort_by_"):
        return _results(n, catalog, s.query, s.max_price, name[len("sort_by_") :])
    if name == "next_page":
        return _set(n, kind="results", **{**keep, "page_no": s.page_no + 1})
    if name.startswith(("product_", "deal_", "related_")):
        slug = name.split("_", 1)[1]
        return _set(n, kind="product", product=by_slug[slug], **keep)
    if name.startswith("option_"):
        return _set(n, kind="product", product=s.product, option=s.product.options[0], **keep)  # type: ignore[union-attr]
    if name == "back_to_results":
        return _set(n, kind="results", **keep) if s.query else _set(n, kind="home")
    if name in ("add_to_cart", "buy_now"):
        n.cart.append(s.product)  # type: ignore[arg-type]
        return _set(n, kind="cart" if name == "add_to_cart" else "checkout")
    if name.startswith("remove_"):
        n.cart = n.cart[1:]
        return _set(n, kind="cart")
    if name in ("proceed_to_checkout", "promo_code"):
        return _set(n, kind="checkout")
    if name == "back_to_cart":
        return _set(n, kind="cart")
    if name == "place_order":
        n.cart = []
        return _set(n, kind="confirmation")
    if name == "continue_shopping":
        return _set(n, kind="home")
    raise ValueError(f"simulator has no transition for {action}")


def _set(n: State, **kw: Any) -> State:
    for k, v in kw.items():
        setattr(n, k, v)
    return n


def _cat_noun(key: str) -> str:
    return next(c.nouns[0] for c in CATEGORIES if c.key == key)


def _results(n: State, catalog: Catalog, query: str, cap: float | None, sort: str) -> State:
    found = search(catalog, query, max_price=cap, sort=sort)[: pages.PAGE_SIZE * 3]
    return _set(n, kind="results", query=query, results=found, max_price=cap, sort=sort)


def render(s: State, catalog: Catalog, order_no: int) -> str:
    """The simplified HTML of the shopper's current page."""
    if s.kind == "home":
        return pages.home_page(s.featured, len(s.cart))
    if s.kind == "results":
        more = len(s.results) > s.page_no * pages.PAGE_SIZE
        return pages.results_page(
            s.query, _shown(s), s.page_no, more, len(s.cart), s.max_price, s.sort
        )
    if s.kind == "product":
        assert s.product is not None
        same = catalog.by_category[s.product.category]
        i = same.index(s.product)
        related = [same[(i + 1) % len(same)], same[(i + 2) % len(same)]]
        return pages.product_page(s.product, s.option, related, len(s.cart))
    if s.kind == "cart":
        return pages.cart_page(s.cart)
    if s.kind == "checkout":
        return pages.checkout_page(s.cart)
    return pages.confirmation_page(order_no)


# ----------------------------------------------------------------------------- sessions


def simulate_session(catalog: Catalog, session_id: str, rng: random.Random) -> Session:
    """Run one shopper from the home page until they terminate."""
    shopper = make_shopper(rng)
    state = State(featured=rng.sample(catalog.products, 3))
    order_no = rng.randrange(10000, 99999)
    steps: list[Step] = []
    while True:
        cands = candidates(state, shopper, rng)
        if state.step >= MAX_STEPS - 1:
            cands = [({"type": "terminate"}, 1.0)]
        total = sum(w for _, w in cands)
        probs = [w / total for _, w in cands]
        action = rng.choices([a for a, _ in cands], weights=probs)[0]
        steps.append(
            Step(
                page=render(state, catalog, order_no),
                action=action,
                rationale=rationale_for(action, state, shopper, rng),
                alternatives=_merge_alternatives(cands, probs),
            )
        )
        if action["type"] == "terminate":
            return Session(session_id=session_id, persona=shopper.persona, steps=steps)
        state = apply(state, action, catalog)


def _merge_alternatives(
    cands: list[tuple[dict[str, str], float]], probs: list[float]
) -> list[tuple[str, float]]:
    merged: dict[str, float] = {}
    for (a, _), p in zip(cands, probs, strict=True):
        key = action_to_json(a)
        merged[key] = merged.get(key, 0.0) + p
    return sorted(((k, round(v, 4)) for k, v in merged.items()), key=lambda kv: -kv[1])


def generate_sessions(num_sessions: int, seed: int = 0) -> list[Session]:
    """``num_sessions`` simulated sessions; deterministic in ``seed``."""
    catalog = build_catalog(random.Random(f"shop-r1-catalog-{seed}"))
    return [
        simulate_session(catalog, f"sim{seed}-{i:06d}", random.Random(f"shop-r1-{seed}-{i}"))
        for i in range(num_sessions)
    ]

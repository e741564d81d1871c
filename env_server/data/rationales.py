"""First-person rationales for simulated actions (what the shopper would say they think), for
env_server/data/simulator.py."""

from __future__ import annotations

import random

from env_server.data.shopper import Shopper, State


def _wants(sh: Shopper) -> str:
    return " and ".join(sh.wants)


def _search(action: dict[str, str], s: State, sh: Shopper, rng: random.Random) -> str:
    q = action["text"]
    if s.kind == "results":
        return rng.choice(
            (
                f'These results are not quite what I need, so I\'ll refine my search to "{q}".',
                f'I want something {_wants(sh)}; searching "{q}" should narrow it down.',
                f'Nothing here fits my budget of about ${sh.budget:.0f}, so I\'m trying "{q}".',
            )
        )
    if s.kind == "product":
        return f"This one isn't right for me. I'll go back to searching for \"{q}\"."
    return rng.choice(
        (
            f"I'm looking for a {sh.category.nouns[0]}, so I'll search for \"{q}\".",
            f'As {sh.persona}, I want a {_wants(sh)} {sh.category.nouns[0]}; let me search "{q}".',
            f'The fastest way to find what I need is the search box: "{q}".',
        )
    )


def _click(action: dict[str, str], s: State, sh: Shopper, rng: random.Random) -> str:
    name = action["name"]
    if name.startswith(("product_", "deal_")):
        slug = name.split("_", 1)[1]
        p = next((x for x in s.results + s.featured if x.slug == slug), None)
        if p is not None:
            return rng.choice(
                (
                    f"The {p.title} looks promising at ${p.price:.2f} with {p.rating} stars; "
                    f"I'll open it to check the details.",
                    f"I want something {_wants(sh)} and the {p.title} seems to match. Let me look.",
                    f"{p.rating} stars from {p.reviews} reviews is reassuring, so I'll check the "
                    f"{p.brand} one.",
                )
            )
    fixed = {
        "add_to_cart": "This matches what I want and the price is fine, so I'll add it to my cart.",
        "buy_now": "I'm convinced this is the one; I'll buy it right away.",
        "back_to_results": "This isn't quite right. I'll go back to the results and compare.",
        "proceed_to_checkout": "My cart has what I need, so I'll proceed to checkout.",
        "continue_shopping": "I want to look around a bit more before I'm done.",
        "place_order": "Everything looks correct, so I'll place the order.",
        "back_to_cart": "I want to double-check my cart before paying.",
        "next_page": "None of these stand out yet; I'll see the next page of results.",
        "sort_by_rating": "I care about quality, so I'll sort the results by rating.",
    }
    if name in fixed:
        return fixed[name]
    if name.startswith("filter_under_"):
        cap = name.rsplit("_", 1)[1]
        return f"Several of these are over my budget, so I'll filter to items under ${cap}."
    if name.startswith("option_"):
        return "Before deciding, I'll pick the option I prefer."
    if name.startswith("nav_"):
        return f"I'll browse the {sh.category.nouns[0]} category to see what's available."
    if name.startswith("remove_"):
        return "On second thought I don't need this item; I'll remove it from my cart."
    return "I'll click this to continue."


def _terminate(s: State, sh: Shopper, rng: random.Random) -> str:
    if s.kind == "confirmation":
        return "My order is placed, so I'm done shopping for now."
    if s.kind in ("cart", "checkout"):
        return rng.choice(
            (
                "I'm not ready to pay yet; I'll think about it and come back later.",
                "The total is more than I wanted to spend today, so I'll stop here.",
            )
        )
    if s.kind == "product" and s.product is not None:
        return rng.choice(
            (
                f"The {s.product.title} is not convincing enough for me, so I'll stop here.",
                f"At ${s.product.price:.2f} I'm not sure it's worth it; I'll leave it for now.",
            )
        )
    return rng.choice(
        (
            "I haven't found anything that fits what I want, so I'll leave the site.",
            "This is taking too long; I'll come back to it another time.",
            f"None of these are {_wants(sh)} at a price I like, so I'm done for now.",
        )
    )


def rationale_for(action: dict[str, str], s: State, sh: Shopper, rng: random.Random) -> str:
    """A first-person reason for ``action`` on the shopper's current page."""
    if action["type"] == "terminate":
        return _terminate(s, sh, rng)
    if action["type"] == "type_and_submit":
        if action["name"] == "promo_code":
            return "I have a promo code, so I'll try it before paying."
        return _search(action, s, sh, rng)
    return _click(action, s, sh, rng)

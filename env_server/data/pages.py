"""Simplified HTML of the shop's pages.

As in the paper's data, pages are stripped to their content and interactive elements; every
element a shopper can act on carries a unique ``name`` attribute, which is what an action
names. Pages are kept short: whole-session prompts must fit a small model's context.
"""

from __future__ import annotations

from collections.abc import Sequence

from env_server.data.catalog import CATEGORIES, Product

PAGE_SIZE = 5
"""Products per search-results page."""

PRICE_FILTERS: tuple[int, ...] = (25, 50, 100, 200)
"""Price caps offered as filter links (only the ones below the result's top price show)."""


def option_name(p: Product, option: str) -> str:
    """Element name of a product option button, e.g. ``option_size_1_7_oz``."""
    return f"option_{p.option_name}_{option.replace(' ', '_').replace('.', '')}"


def _header(query: str, cart_count: int) -> str:
    value = query.replace('"', "&quot;")
    return (
        f'<header><input type="text" name="search_input" placeholder="Search products" '
        f'value="{value}"/> <a name="cart_link">Cart ({cart_count})</a></header>'
    )


def _stars(p: Product) -> str:
    return f"{p.rating} stars ({p.reviews} reviews)"


def home_page(featured: Sequence[Product], cart_count: int) -> str:
    cats = " ".join(f'<a name="nav_{c.key}">{c.nouns[0].title()}</a>' for c in CATEGORIES[:8])
    deals = "\n".join(
        f'<li><a name="deal_{p.slug}">{p.title}</a> ${p.price:.2f}</li>' for p in featured
    )
    return (
        f"<html><body>\n{_header('', cart_count)}\n<nav>{cats}</nav>\n"
        f"<h2>Today's deals</h2>\n<ul>\n{deals}\n</ul>\n</body></html>"
    )


def results_page(
    query: str,
    products: Sequence[Product],
    page_no: int,
    has_next: bool,
    cart_count: int,
    max_price: float | None,
    sort: str,
) -> str:
    if products:
        items = "\n".join(
            f'<li><a name="product_{p.slug}">{p.title}</a> ${p.price:.2f} {_stars(p)}</li>'
            for p in products
        )
        body = f"<ul>\n{items}\n</ul>"
    else:
        body = "<p>No results found. Try different keywords.</p>"
    filters = " ".join(
        f'<a name="filter_under_{cap}">Under ${cap}</a>'
        for cap in PRICE_FILTERS
        if max_price is None or cap < max_price
    )
    sorts = " ".join(
        f'<a name="sort_by_{s}">Sort by {s}</a>' for s in ("price", "rating") if s != sort
    )
    nav = ' <a name="next_page">Next page</a>' if has_next else ""
    return (
        f"<html><body>\n{_header(query, cart_count)}\n"
        f'<h1>Results for "{query}" (page {page_no})</h1>\n<div>{filters} {sorts}</div>\n'
        f"{body}\n<footer>{nav.strip()}</footer>\n</body></html>"
    )


def product_page(
    p: Product, chosen_option: str | None, related: Sequence[Product], cart_count: int
) -> str:
    opts = " ".join(
        f'<button name="{option_name(p, o)}">'
        f"{o}{' (selected)' if o == chosen_option else ''}</button>"
        for o in p.options
    )
    reviews = "\n".join(f"<li>{t}</li>" for t in p.review_texts)
    rel = " ".join(f'<a name="related_{r.slug}">{r.title}</a>' for r in related)
    return (
        f"<html><body>\n{_header('', cart_count)}\n<h1>{p.title}</h1>\n"
        f"<p>${p.price:.2f} | {_stars(p)}</p>\n<div>{p.option_name.title()}: {opts}</div>\n"
        f'<button name="add_to_cart">Add to cart</button> <button name="buy_now">Buy now</button> '
        f'<a name="back_to_results">Back to results</a>\n'
        f"<h2>Reviews</h2>\n<ul>\n{reviews}\n</ul>\n<h2>Related</h2>\n<div>{rel}</div>\n"
        f"</body></html>"
    )


def cart_page(items: Sequence[Product]) -> str:
    rows = "\n".join(
        f'<li>{p.title} ${p.price:.2f} <button name="remove_{p.slug}">Remove</button></li>'
        for p in items
    )
    total = sum(p.price for p in items)
    return (
        f"<html><body>\n{_header('', len(items))}\n<h1>Shopping cart</h1>\n<ul>\n{rows}\n</ul>\n"
        f"<p>Subtotal: ${total:.2f}</p>\n"
        f'<button name="proceed_to_checkout">Proceed to checkout</button> '
        f'<a name="continue_shopping">Continue shopping</a>\n</body></html>'
    )


def checkout_page(items: Sequence[Product]) -> str:
    total = sum(p.price for p in items)
    return (
        f"<html><body>\n<h1>Checkout</h1>\n<p>{len(items)} item(s), total ${total:.2f}</p>\n"
        f'<input type="text" name="promo_code" placeholder="Promo code"/>\n'
        f"<p>Ship to: saved address | Pay with: saved card</p>\n"
        f'<button name="place_order">Place order</button> <a name="back_to_cart">Back to cart</a>\n'
        f"</body></html>"
    )


def confirmation_page(order_no: int) -> str:
    return (
        f"<html><body>\n{_header('', 0)}\n<h1>Thank you! Order #{order_no} is confirmed.</h1>\n"
        f'<a name="continue_shopping">Continue shopping</a> <a name="view_order">View order</a>\n'
        f"</body></html>"
    )

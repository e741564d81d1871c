"""The route tables of the docs (api/README.md, docs/BRIDGE.md) as the auth tests read them."""

from __future__ import annotations

import re
from pathlib import Path


def documented(name: str, path: Path) -> dict[tuple[str, str], str]:
    """``(method, path template) -> needs`` from the ``<!-- routes: name -->`` table of
    ``path`` (first column `` `METHOD /path` ``, second what the route needs)."""
    text = path.read_text()
    body = text.split(f"<!-- routes: {name} -->", 1)[1].split("<!-- /routes -->", 1)[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        method, route = cells[0].strip("`").split(" ", 1)
        rows[(method, route)] = cells[1]
    return rows


def concrete(template: str) -> str:
    """A path that matches ``template`` (each ``{param}`` filled in)."""
    return re.sub(r"\{[^}]+\}", "b-1", template)

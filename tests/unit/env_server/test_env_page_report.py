"""The per-page report: page kinds read off the simulator's HTML, the oracle policies, and the
breakdown of a model's predictions (exact, DARS hits, clicks naming no element of the page)."""

from __future__ import annotations

import json

import pytest

from env_server.data.dataset import build_dataset
from env_server.page_report import (
    PAGE_KINDS,
    format_breakdown,
    format_oracle,
    oracle_policies,
    page_kind,
    prediction_breakdown,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return build_dataset(60, seed=3)["train"].to_list()


def completion(action: dict) -> str:
    return json.dumps({"rationale": "because", "action": action})


def test_every_simulated_page_has_a_kind(rows: list[dict]) -> None:
    kinds = {page_kind(r["pages"][-1]) for r in rows}
    assert kinds >= {"home", "results", "product", "cart", "checkout", "confirmation"}
    assert "other" not in kinds
    assert page_kind("<html><body>not a shop</body></html>") == "other"
    # what the gold action clicks is on the page it was taken on (the kinds line up)
    for r in rows:
        gold = json.loads(r["action"])
        if gold["type"] == "click" and page_kind(r["pages"][-1]) == "results":
            assert f'name="{gold["name"]}"' in r["pages"][-1]


def test_oracle_policies_bound_each_other(rows: list[dict]) -> None:
    o = oracle_policies(rows)
    exact_opt, reward_opt = o["exact_optimal"], o["reward_optimal"]
    assert exact_opt["all"][2] == len(rows)
    for kind, (exact, reward, n) in exact_opt.items():
        # the most likely action maximises expected exact match, the reward optimum the reward
        assert exact >= reward_opt[kind][0] - 1e-9
        assert reward_opt[kind][1] >= reward - 1e-9
        assert reward_opt[kind][2] == n
    # the simulated shopper leaves a confirmation page almost surely, yet a right
    # `terminate` is worth 0.8 against ~1000 for a right click name: the two optima differ
    if "confirmation" in exact_opt:
        n = exact_opt["confirmation"][2]
        assert exact_opt["confirmation"][0] > 0.8 * n
        assert reward_opt["confirmation"][0] < 0.2 * n
    table = format_oracle(o)
    assert "| exact_optimal |" in table and "| rows |" in table


def test_prediction_breakdown_counts_exact_hits_and_off_page_clicks(rows: list[dict]) -> None:
    gold_rows = rows[:40]
    completions = []
    for i, r in enumerate(gold_rows):
        if i % 4 == 0:
            completions.append("not json")
        elif i % 4 == 1:
            completions.append(completion({"type": "click", "name": "no_such_element_xyz"}))
        else:
            completions.append(completion(json.loads(r["action"])))
    b = prediction_breakdown(gold_rows, completions)
    assert set(b) <= set(PAGE_KINDS)
    total = {k: sum(c[k] for c in b.values()) for k in ("rows", "exact", "invalid")}
    assert total == {"rows": 40, "exact": 20, "invalid": 10}
    assert sum(c["click_off_page"] for c in b.values()) == 10
    # a gold click or a gold type_and_submit earns its DARS credit; terminate has none
    hard = sum(
        json.loads(r["action"])["type"] != "terminate"
        for i, r in enumerate(gold_rows)
        if i % 4 >= 2
    )
    assert sum(c["dars_hits"] for c in b.values()) == hard
    assert "| **all** | 40 | 20 (50.0%)" in format_breakdown("x", b)
    with pytest.raises(ValueError, match="completions for"):
        prediction_breakdown(gold_rows, completions[:-1])


def test_compare_pages_counts_per_page_and_results_clicks(rows: list[dict]) -> None:
    from env_server.page_report import compare_pages

    rows = rows[:40]
    gold = [completion(json.loads(r["action"])) for r in rows]
    off = [completion({"type": "click", "name": "no_such_element_xyz"}) for _ in rows]
    table = compare_pages(rows, {"gold": gold, "off": off})
    results = [r for r in rows if page_kind(r["pages"][-1]) == "results"]
    gold_clicks = sum(json.loads(r["action"])["type"] == "click" for r in results)
    n = len(results)
    assert f"| results | {n} | {n} (100.0%) |" in table  # gold is exact everywhere
    assert f"gold {gold_clicks} of {gold_clicks}" in table  # a gold click is on its page
    assert f"off 0 of {n} (0.0%)" in table


def test_what_changed_counts_gains_losses_and_what_is_predicted_where_the_shopper_leaves(
    rows: list[dict],
) -> None:
    from env_server.page_report import what_changed

    rows = rows[:60]
    gold = [completion(json.loads(r["action"])) for r in rows]
    wrong = completion({"type": "click", "name": "no_such_element_xyz"})  # never exact
    leave = [json.loads(r["action"])["type"] == "terminate" for r in rows]
    # before: gold on the even rows; after: gold except where the shopper leaves (it clicks)
    before = [g if i % 2 == 0 else wrong for i, g in enumerate(gold)]
    after = [wrong if stop else g for g, stop in zip(gold, leave, strict=True)]
    table = what_changed(rows, before, after)
    even = [i % 2 == 0 for i in range(len(rows))]
    gained = sum(not e and not s for e, s in zip(even, leave, strict=True))
    lost = sum(e and s for e, s in zip(even, leave, strict=True))
    n_leave, kept = sum(leave), sum(e and s for e, s in zip(even, leave, strict=True))
    assert 0 < n_leave < len(rows) and 0 < kept < n_leave
    assert (
        f"| **all** | | 60 | {sum(even)} | {60 - n_leave} | {gained} | {lost} | {gained - lost:+d} |"
        in table
    )
    assert f"Where the shopper leaves ({n_leave} rows, gold terminate), predicted: " in table
    assert f"SFT click {n_leave - kept}, terminate {kept}; RL click {n_leave}." in table
    for line in table.splitlines()[2:-3]:  # per cell: net = gained - lost = the exact change
        cells = [c.strip() for c in line.strip("|").split("|")]
        n, a, b, g, lo, d = (int(x) for x in cells[2:])
        assert d == g - lo == b - a and 0 <= a <= n and 0 <= b <= n
    with pytest.raises(ValueError, match="completions for"):
        what_changed(rows, before, after[:-1])

"""Strict parser and hierarchical reward against hand-computed cases (paper Table 1).

ROUGE-L values in the comments are worked out by hand: rouge-score lowercases and splits on
non-alphanumerics, so ``product_kuro_l370_...`` is the words ``product kuro l370 ...``.
"""

from __future__ import annotations

import json

import pytest

from env_server.reward import (
    PAPER_COMPONENTS,
    REGISTRY,
    FormatFailure,
    ParsedOutput,
    RewardConfig,
    RewardSpec,
    RewardTerm,
    parse_output,
    rationale_char_span,
    register,
    rouge_l,
    score,
)

pytestmark = pytest.mark.unit


def out(action: dict, rationale: str = "I want this.") -> str:
    return json.dumps({"rationale": rationale, "action": action})


CLICK = {"type": "click", "name": "add_to_cart"}
SEARCH = {"type": "type_and_submit", "name": "search_input", "text": "wireless headphones"}
KURO = "product_kuro_l370_stainless_steel_paring_knife"  # 7 words


# ----------------------------------------------------------------------------- parser


@pytest.mark.parametrize(
    "text",
    [
        out(CLICK),
        "  \n" + out(CLICK) + "\n ",
        '{"action": {"name": "add_to_cart", "type": "click"}, "rationale": "r"}',
        out({"type": "click", "name": "add_to_cart", "text": ""}),
        out({"type": "terminate"}),
        out({"type": "terminate", "name": "", "text": ""}),
        out(SEARCH, rationale='Ich möchte "leise" Kopfhörer ✓'),
    ],
)
def test_parser_accepts_well_formed(text: str) -> None:
    parsed = parse_output(text)
    assert isinstance(parsed, ParsedOutput), parsed
    assert parsed.rationale.strip()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "does not start"),
        ("I will click add to cart.", "does not start"),
        ("```json\n" + out(CLICK) + "\n```", "does not start"),
        (out(CLICK) + " Done.", "text after"),
        (out(CLICK) + out(CLICK), "text after"),
        ("[" + out(CLICK) + "]", "does not start"),
        ('{"rationale": "r", "action": {"type": "click", "name": "a"}', "expected ','"),
        ('{"rationale": "r"}', "exactly rationale and action"),
        ('{"action": {"type": "terminate"}}', "exactly rationale and action"),
        ('{"rationale": "r", "action": {"type": "terminate"}, "x": 1}', "exactly"),
        ('{"rationale": "", "action": {"type": "terminate"}}', "non-empty"),
        ('{"rationale": "   ", "action": {"type": "terminate"}}', "non-empty"),
        ('{"rationale": 3, "action": {"type": "terminate"}}', "non-empty"),
        ('{"rationale": "r", "action": "click add_to_cart"}', "not an object"),
        ('{"rationale": "r", "action": {"type": "scroll"}}', "not one of"),
        ('{"rationale": "r", "action": {"name": "a"}}', "not one of"),
        ('{"rationale": "r", "action": {"type": "click"}}', "needs a non-empty"),
        ('{"rationale": "r", "action": {"type": "click", "name": ""}}', "needs a non-empty"),
        ('{"rationale": "r", "action": {"type": "click", "name": 5}}', "needs a non-empty"),
        ('{"rationale": "r", "action": {"type": "click", "name": "a", "text": "b"}}', "takes no"),
        ('{"rationale": "r", "action": {"type": "terminate", "name": "x"}}', "takes no"),
        ('{"rationale": "r", "action": {"type": "terminate", "text": null}}', "takes no"),
        ('{"rationale": "r", "action": {"type": "type_and_submit", "name": "s"}}', "needs"),
        ('{"rationale": "r", "action": {"type": "click", "name": "a", "id": 1}}', "unknown"),
        ('{"rationale": "a", "rationale": "b", "action": {"type": "terminate"}}', "duplicate"),
        ('{"rationale": "r", "action": {"type": "click", "name": "a", "name": "b"}}', "duplicate"),
        ("{" * 100000, "quoted key"),
        ('{"rationale": "r", "action": {"type": "terminate"} ', "expected ','"),
        ('{"rationale": "unterminated, "action": {"type": "terminate"}}', "expected ','"),
        ('{"rationale" "r", "action": {"type": "terminate"}}', "expected ':'"),
        ('{"rationale": "never closed', "unterminated string"),
    ],
)
def test_parser_rejects_malformed(text: str, why: str) -> None:
    parsed = parse_output(text)
    assert isinstance(parsed, FormatFailure)
    assert why.lower() in parsed.reason.lower(), parsed.reason


@pytest.mark.parametrize("value", [None, b'{"rationale": "r"}', 42, ["x"]])
def test_parser_never_raises_on_non_text(value: object) -> None:
    assert isinstance(parse_output(value), FormatFailure)


def test_rationale_span_covers_the_raw_string_content() -> None:
    text = '{"action": {"type": "terminate"}, "rationale": "I said \\"bye\\" and left"}'
    start, end = rationale_char_span(text)  # type: ignore[misc]
    assert text[start:end] == 'I said \\"bye\\" and left'
    assert text[start - 1] == '"' and text[end] == '"'
    assert rationale_char_span("not json") is None


# ----------------------------------------------------------------------------- reward


def test_rouge_l_matches_hand_computation() -> None:
    assert rouge_l(KURO, KURO) == pytest.approx(1.0)
    # 6 of 7 words in common, same length: P = R = F = 6/7
    assert rouge_l(KURO.replace("l370", "l371"), KURO) == pytest.approx(6 / 7)
    # pred 4 words, gold 2, LCS 2: P = 1/2, R = 1, F = 2/3
    assert rouge_l("wireless noise cancelling headphones", "wireless headphones") == pytest.approx(
        2 / 3
    )
    assert rouge_l("", "x") == 0.0


@pytest.mark.parametrize(
    ("gold", "pred", "total"),
    [
        # click: format 0.5 + type 0.3 + name present 0.2 + DARS 1000 x ROUGE-L 1.0
        (CLICK, CLICK, 1001.0),
        # wrong element, ROUGE-L 0: no similarity credit
        (CLICK, {"type": "click", "name": "buy_now"}, 1.0),
        # ROUGE-L 6/7 >= 0.75: credited 1000 x 6/7
        (
            {"type": "click", "name": KURO},
            {"type": "click", "name": KURO.replace("l370", "l371")},
            1.0 + 1000 * 6 / 7,
        ),
        # ROUGE-L 3/5 = 0.6 < 0.75: presence only
        (
            {"type": "click", "name": "product_a_b_c_d"},
            {"type": "click", "name": "product_a_b_x_y"},
            1.0,
        ),
        # type_and_submit exact: 0.5 + 0.3 + 0.1 + 0.1 + 0.1 x 1 + 1000 x 1
        (SEARCH, SEARCH, 1001.1),
        # text ROUGE-L 2/3 < 0.75: presence + name similarity only
        (SEARCH, {**SEARCH, "text": "wireless noise cancelling headphones"}, 1.1),
        # text: pred 3 words, gold 4, LCS 3 -> P 1, R 3/4, F 6/7
        (
            {**SEARCH, "text": "noise cancelling wireless headphones"},
            {**SEARCH, "text": "noise cancelling headphones"},
            1.1 + 1000 * 6 / 7,
        ),
        # name 'search box' vs 'search input': F 1/2 < 0.75, no name similarity; text exact
        (SEARCH, {**SEARCH, "name": "search_box"}, 1001.0),
        # wrong type: format only, no attribute credit
        (CLICK, {"type": "terminate"}, 0.5),
        (SEARCH, {"type": "click", "name": "search_input"}, 0.5),
        # terminate: format + type
        ({"type": "terminate"}, {"type": "terminate"}, 0.8),
    ],
)
def test_hierarchical_reward_table1(gold: dict, pred: dict, total: float) -> None:
    r = score(out(pred), gold)
    assert r.valid
    assert r.total == pytest.approx(total)
    parts = r.format + r.type + r.name + r.text + r.name_similarity + r.text_similarity
    assert parts == pytest.approx(r.total)


def test_components_reported_separately() -> None:
    r = score(
        out({**SEARCH, "text": "noise cancelling headphones"}),
        {**SEARCH, "text": "noise cancelling wireless headphones"},
    )
    assert (r.format, r.type, r.name, r.text) == (0.5, 0.3, 0.1, 0.1)
    assert r.name_similarity == pytest.approx(0.1)
    assert r.rouge_text == pytest.approx(6 / 7)
    assert r.text_similarity == pytest.approx(1000 * 6 / 7)
    assert not r.exact_match and r.type_match
    m = r.metrics()
    assert m["rouge_text"] == pytest.approx(6 / 7) and m["valid"] == 1.0


def test_format_failure_scores_zero() -> None:
    r = score("Sure! I'd click add to cart.", CLICK)
    assert r.total == 0.0 and not r.valid and r.failure


@pytest.mark.parametrize(
    ("variant", "pred", "total"),
    [
        ("binary", CLICK, 1.0),
        ("binary", {"type": "click", "name": "Add_To_Cart "}, 1.0),  # normalized exact match
        ("binary", {"type": "click", "name": "buy_now"}, 0.0),
        ("no_dars", CLICK, 0.5 + 0.3 + 0.2 + 1.0),
        ("no_format", CLICK, 0.3 + 0.2 + 1000.0),
        ("no_format", {"type": "terminate"}, 0.0),
        ("full", CLICK, 1001.0),
    ],
)
def test_ablation_variants(variant: str, pred: dict, total: float) -> None:
    assert score(out(pred), CLICK, RewardConfig.variant(variant)).total == pytest.approx(total)


def test_variants_still_gate_on_format() -> None:
    for name in ("binary", "no_dars", "no_format"):
        assert score("garbage", CLICK, RewardConfig.variant(name)).total == 0.0
    with pytest.raises(ValueError, match="unknown reward variant"):
        RewardConfig.variant("nope")


def test_attribute_credit_without_type_match_when_configured() -> None:
    cfg = RewardConfig(attributes_require_type_match=False)
    pred = {"type": "type_and_submit", "name": "add_to_cart", "text": "x"}
    # gold click rules apply to the predicted name: 0.5 + 0 (type) + 0.2 + 1000 x 1
    assert score(out(pred), CLICK, cfg).total == pytest.approx(1000.7)
    assert score(out(pred), CLICK).total == pytest.approx(0.5)


def test_threshold_and_dars_are_configurable() -> None:
    pred = {"type": "click", "name": "product_a_b_x_y"}  # ROUGE-L 0.6 against the gold
    gold = {"type": "click", "name": "product_a_b_c_d"}
    cfg = RewardConfig(rouge_threshold=0.5, dars_factor=10.0)
    assert score(out(pred), gold, cfg).total == pytest.approx(1.0 + 10 * 0.6)


# ----------------------------------------------------------------------------- registry


def test_default_spec_is_table1_bit_for_bit() -> None:
    """RewardSpec() (the default recipe) == the flat Table-1 RewardConfig, exactly."""
    spec = RewardSpec()
    assert spec.weights == {k: v for k, v in PAPER_COMPONENTS.items() if k != "dars"}
    golds = [CLICK, SEARCH, {"type": "terminate"}, {"type": "click", "name": KURO}]
    preds = [
        *golds,
        {"type": "click", "name": KURO.replace("l370", "l371")},
        {**SEARCH, "text": "wireless noise cancelling headphones"},
        {**SEARCH, "name": "search_box"},
    ]
    for gold in golds:
        for pred in preds:
            a, b = score(out(pred), gold, spec), score(out(pred), gold, RewardConfig())
            assert a.total == b.total and a.components == b.components
            assert sum(a.components.values()) == pytest.approx(a.total)


def test_components_name_every_entry() -> None:
    r = score(out(SEARCH), SEARCH)
    assert r.components == {
        "format": 0.5,
        "type": 0.3,
        "click_name": 0.0,
        "click_name_rouge": 0.0,
        "tas_name": 0.1,
        "tas_text": 0.1,
        "tas_name_rouge": 0.1,
        "tas_text_rouge": 1000.0,
    }
    bad = score("nope", SEARCH)
    assert bad.total == 0.0 and set(bad.components) == set(r.components)
    assert not any(bad.components.values())


def test_weights_are_normalized_to_the_papers_budget_of_the_listed_entries() -> None:
    # relative weights 1:1 share the paper's 0.5 + 0.3 budget of these two entries
    spec = RewardSpec(components={"format": 1.0, "type": 1.0})
    assert spec.weights == pytest.approx({"format": 0.4, "type": 0.4})
    assert score(out(CLICK), CLICK, spec).total == pytest.approx(0.8)
    # paper weights x 10: normalized back to the paper's
    tenfold = {k: 10 * v for k, v in PAPER_COMPONENTS.items() if k != "dars"}
    scaled = RewardSpec(components=tenfold | {"dars": 1000.0})
    assert scaled.weights == pytest.approx(RewardSpec().weights)
    # dropping an entry (an ablation) leaves the others at the paper's values
    assert RewardSpec(components={"type": 0.3, "exact_match": 1.0}).weights == {
        "type": 0.3,
        "exact_match": 1.0,
    }
    raw = RewardSpec(components={"format": 1.0, "type": 1.0}, normalize=False)
    assert raw.weights == {"format": 1.0, "type": 1.0}


def test_dars_is_a_scale_entry() -> None:
    no_dars = RewardSpec(components={k: v for k, v in PAPER_COMPONENTS.items() if k != "dars"})
    assert score(out(CLICK), CLICK, no_dars).total == pytest.approx(0.5 + 0.3 + 0.2 + 1.0)
    ten = RewardSpec(components=PAPER_COMPONENTS | {"dars": 10.0})
    assert score(out(CLICK), CLICK, ten).total == pytest.approx(1.0 + 10.0)


@pytest.mark.parametrize(
    ("components", "why"),
    [
        ({"formatt": 0.5}, "unknown reward component"),
        ({"format": -1.0}, ">= 0"),
        ({"dars": 1000.0}, "at least one credit"),
        ({"format": 0.0}, "sum to 0"),
    ],
)
def test_bad_specs_are_clear_errors(components: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        RewardSpec(components=components)


def test_a_new_term_is_a_registration_not_an_edit() -> None:
    term = RewardTerm(
        "short_rationale",
        "credit",
        0.1,
        "Rationale under 40 characters.",
        lambda c: 1.0 if len(c.rationale) < 40 else 0.0,
    )
    register(term)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register(term)
        spec = RewardSpec(components={"format": 0.5, "short_rationale": 0.1})
        r = score(out(CLICK), CLICK, spec)
        assert r.components == {"format": 0.5, "short_rationale": 0.1}
        assert r.total == pytest.approx(0.6)
        long = score(out(CLICK, rationale="x" * 50), CLICK, spec)
        assert long.components["short_rationale"] == 0.0
    finally:
        del REGISTRY["short_rationale"]

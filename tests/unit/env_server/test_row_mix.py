"""env_server's ``row_mix``: which train rows GRPO samples (natural mix or balanced types)."""

from __future__ import annotations

import collections
import itertools
import json

import pytest

from env_server.config import EnvConfig
from env_server.service import cycle_rows

pytestmark = pytest.mark.unit

TYPES = ["click"] * 6 + ["terminate"] * 2 + ["type_and_submit"] * 4


def rows() -> list[dict]:
    return [
        {"id": i, "action": json.dumps({"type": t}), "action_type": t} for i, t in enumerate(TYPES)
    ]


def kind(row: dict) -> str:
    return json.loads(row["action"])["type"]


def test_balanced_draws_each_action_type_in_turn_and_every_row_of_a_type_before_repeating() -> None:
    drawn = list(itertools.islice(cycle_rows(rows(), seed=5, row_mix="balanced"), 36))
    assert [kind(r) for r in drawn] == ["click", "terminate", "type_and_submit"] * 12
    for t, n in collections.Counter(TYPES).items():
        ids = [r["id"] for r in drawn if kind(r) == t]
        for start in range(0, 12 - n + 1, n):  # each pass over a type holds all of its rows
            assert sorted(ids[start : start + n]) == [r["id"] for r in rows() if kind(r) == t]


def test_balanced_order_is_a_function_of_the_seed() -> None:
    def first(seed: int) -> list[int]:
        return [r["id"] for r in itertools.islice(cycle_rows(rows(), seed, row_mix="balanced"), 24)]

    assert first(1) == first(1)
    assert first(1) != first(2)


def test_natural_is_the_default_order() -> None:
    n = len(TYPES)
    plain = list(itertools.islice(cycle_rows(rows(), seed=3), n))
    assert plain == list(itertools.islice(cycle_rows(rows(), seed=3, row_mix="natural"), n))
    assert collections.Counter(kind(r) for r in plain) == collections.Counter(TYPES)


def test_balanced_steps_only_and_unknown_mixes_are_errors() -> None:
    with pytest.raises(ValueError, match="session"):
        next(cycle_rows(rows(), 0, by_session=True, row_mix="balanced"))
    with pytest.raises(ValueError, match="'natural' or 'balanced'"):
        next(cycle_rows(rows(), 0, row_mix="uniform"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not apply to episode: session"):
        EnvConfig(row_mix="balanced", episode="session")
    assert EnvConfig(row_mix="balanced").row_mix == "balanced"

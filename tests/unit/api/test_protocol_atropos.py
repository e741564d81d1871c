"""The typed Atropos fields of a group (api/protocol_atropos.py, ``ScoredGroup.atropos``):
built by the API's conversion, read back unchanged, the older ``extras["atropos"]`` form
(queues and dumps written before the field) lifted into it, and each check that makes the
trainer refuse a group, named by position."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
from pydantic import ValidationError

from api import atropos_wire
from api.atropos_convert import from_native, to_native
from api.protocol import ScoredGroup
from api.protocol_atropos import NATIVE, AtroposFields, AtroposSequence
from trainer.atropos_fields import refusal
from trainer.batch import flatten_groups
from trainer.config import GrpoConfig

pytestmark = pytest.mark.unit
PROMPT = [3, 7, 11, 13]
COMPLETIONS = [[20, 21, 22], [30, 31, 32, 33]]
TOKENS = [PROMPT + c for c in COMPLETIONS]


def item(**kw) -> dict:
    return {
        "tokens": TOKENS,
        "masks": [[-100] * len(PROMPT) + c for c in COMPLETIONS],
        "scores": [1.0, 0.0],
        "inference_logprobs": [[0.0] * len(PROMPT) + [-3.0] * len(c) for c in COMPLETIONS],
        **kw,
    }


def native_json(atropos_item: dict) -> str:
    """An Atropos group as the API stores it and converts it for a native lease."""
    prepared = atropos_wire.prepare(msgspec.Raw(json.dumps(atropos_item).encode()), "zeros")
    return to_native(prepared.payload, "g", "toy", 0)


def old_form(converted: str) -> str:
    """The same group as the API converted it before the typed field: ``extras.atropos``."""
    group = json.loads(converted)
    group["extras"] = {"atropos": group.pop("atropos")}
    return json.dumps(group)


EVERYTHING = item(
    inference_logprobs=None,
    advantages=[[0.0] * 4 + [1.0, 2.0, 3.0], [0.0] * 4 + [-0.5] * 4],
    ref_logprobs=[[-1.0] * 7, [-2.0] * 8],
    messages=[[{"role": "user", "content": "hi"}]] * 2,
    generation_params={"temperature": 1.0, "top_p": 0.9},
    overrides=[{}, {"set_advantage_to_zero": True}],
    group_overrides={"group_id": "x1", "group_size": 2},
    env_id=3,
    masks=[[-100] * 4 + [20, 21, 99], [-100] * 4 + COMPLETIONS[1]],  # a label not its token
)


# -- the wire form ---------------------------------------------------------------------------


def test_round_trip_keeps_every_field() -> None:
    converted = native_json(EVERYTHING)
    g = ScoredGroup.model_validate_json(converted)
    assert g.extras == {} and g.atropos is not None
    assert g.atropos.advantages == EVERYTHING["advantages"]
    assert g.atropos.ref_logprobs == EVERYTHING["ref_logprobs"]
    assert g.atropos.overrides == EVERYTHING["overrides"]
    assert g.atropos.group_overrides == EVERYTHING["group_overrides"]
    assert g.atropos.generation_params == EVERYTHING["generation_params"]
    assert g.atropos.messages == EVERYTHING["messages"] and g.atropos.env_id == 3
    assert g.atropos.masks == EVERYTHING["masks"]  # kept: not in label form
    assert g.atropos.inference_logprobs_missing
    # serialised again: the same JSON object (fields not sent stay left out), parsed the same
    dumped = json.loads(g.model_dump_json())
    assert dumped["atropos"] == json.loads(converted)["atropos"]
    assert ScoredGroup.model_validate_json(g.model_dump_json()) == g
    # and served back to an Atropos trainer as sent
    back = json.loads(from_native(g.model_dump_json()))
    for key in ("advantages", "ref_logprobs", "overrides", "group_overrides", "masks", "env_id"):
        assert back[key] == EVERYTHING[key], key
    assert back["inference_logprobs"] is None


def test_a_plain_atropos_group_carries_only_what_it_sent() -> None:
    converted = json.loads(native_json(item()))
    assert converted["extras"] == {} and converted["atropos"] == {}
    g = ScoredGroup.model_validate(converted)
    assert g.atropos == AtroposFields() and json.loads(g.model_dump_json())["atropos"] == {}


def test_a_native_group_serialises_as_before() -> None:
    """No Atropos fields: no ``atropos`` key at all (the byte-for-byte queue payload)."""
    seq = {"tokens": [1, 2], "mask": [0, 1], "logprobs": [0.0, -1.0], "score": 1.0}
    g = ScoredGroup.model_validate(
        {"group_id": "n", "env": "e", "policy_version": 2, "sequences": [seq], "extras": {"k": 1}}
    )
    assert g.atropos is None
    assert g.model_dump_json() == (
        '{"group_id":"n","env":"e","policy_version":2,"sequences":[{"tokens":[1,2],'
        '"mask":[0,1],"logprobs":[0.0,-1.0],"score":1.0,"spans":{}}],"metrics":{},'
        '"extras":{"k":1}}'
    )


def test_the_old_extras_form_is_lifted_to_the_same_values() -> None:
    converted = native_json(EVERYTHING)
    new = ScoredGroup.model_validate_json(converted)
    old = ScoredGroup.model_validate_json(old_form(converted))
    assert old == new and old.extras == {}
    assert old.model_dump_json() == new.model_dump_json()  # stored again in the new form
    # other extras stay where they were; from_native reads either form
    mixed = json.loads(old_form(converted))
    mixed["extras"]["rollouts"] = [1]
    lifted = ScoredGroup.model_validate(mixed)
    assert lifted.extras == {"rollouts": [1]} and lifted.atropos == new.atropos
    assert from_native(json.dumps(mixed)) == from_native(converted)
    # an empty old form is still an Atropos group (its checks apply), not a native one
    empty = ScoredGroup.model_validate_json(old_form(native_json(item())))
    assert empty.atropos == AtroposFields()


def test_old_form_lease_trains_like_the_new(tmp_path: Path) -> None:
    """A native payload with ``extras.atropos``, stored as is in a queue, leased: the trainer
    refuses and flattens it exactly as the group in the new form."""
    from api.store import Row, Store

    converted = native_json(EVERYTHING)
    store = Store(tmp_path / "api.sqlite", synchronous="NORMAL")
    store.ingest_rows([Row("g", "toy", 0, 2, 15, old_form(converted))])
    batch = store.lease(None, 2, 30.0)
    store.close()
    leased = ScoredGroup.model_validate_json(batch.payloads[0])
    new = ScoredGroup.model_validate_json(converted)
    assert leased.atropos == new.atropos
    cfg = GrpoConfig(temperature=1.0)
    assert refusal(leased, cfg) == refusal(new, cfg) is not None  # the relabelled position
    assert flatten_groups([leased], 64) == flatten_groups([new], 64)


OLD_PAYLOAD = (  # what a native lease served for an Atropos group before the typed field
    '{"group_id":"g","env":"toy","policy_version":0,"sequences":[{"tokens":[3,7,20],'
    '"mask":[0,0,1],"logprobs":[0.0,0.0,0.0],"score":1.0},{"tokens":[3,7,30],"mask":[0,0,1],'
    '"logprobs":[0.0,0.0,0.0],"score":0.0}],"metrics":{},"extras":{"atropos":{"advantages":'
    '[[0.0,0.0,1.5],[0.0,0.0,-1.5]],"overrides":[{},{"set_advantage_to_zero":true}],'
    '"group_overrides":{"group_size":2},"masks":[[-100,-100,20],[-100,-100,31]],'
    '"inference_logprobs_missing":true}}}'
)


def test_a_payload_stored_before_parses_to_the_same_values() -> None:
    g = ScoredGroup.model_validate_json(OLD_PAYLOAD)
    assert g.extras == {}
    assert g.atropos == AtroposFields(
        advantages=[[0.0, 0.0, 1.5], [0.0, 0.0, -1.5]],
        overrides=[{}, {"set_advantage_to_zero": True}],
        group_overrides={"group_size": 2},
        masks=[[-100, -100, 20], [-100, -100, 31]],
        inference_logprobs_missing=True,
    )
    posted = {
        "tokens": [[3, 7, 20], [3, 7, 30]],
        "masks": [[-100, -100, 20], [-100, -100, 31]],
        "scores": [1.0, 0.0],
        "advantages": [[0.0, 0.0, 1.5], [0.0, 0.0, -1.5]],
        "overrides": [{}, {"set_advantage_to_zero": True}],
        "group_overrides": {"group_size": 2},
    }
    assert g == ScoredGroup.model_validate_json(native_json(posted))  # as converted today
    assert refusal(g, GrpoConfig()).startswith("masks[1][2] = 31 but tokens[1][2] = 30")
    old = json.loads(OLD_PAYLOAD)["extras"]["atropos"]
    assert json.loads(g.model_dump_json())["atropos"] == old  # the same object, moved


@pytest.mark.parametrize(
    ("extras", "fragment"),
    [
        ({"atropos": {"advantages": "x"}}, "extras.atropos.advantages: Input should be"),
        ({"atropos": {"no_such_field": 1}}, "extras.atropos.no_such_field: Extra inputs"),
        ({"atropos": [1]}, "extras.atropos: Input should be a valid dictionary"),
    ],
)
def test_a_malformed_old_form_names_the_field(extras: dict, fragment: str) -> None:
    g = json.loads(native_json(item()))
    del g["atropos"]
    with pytest.raises(ValidationError, match="extras.atropos") as e:
        ScoredGroup.model_validate({**g, "extras": extras})
    assert fragment in str(e.value)


def test_both_forms_at_once_are_refused() -> None:
    g = json.loads(native_json(item()))
    with pytest.raises(ValidationError, match="give the Atropos fields once"):
        ScoredGroup.model_validate({**g, "extras": {"atropos": {}}})


def test_to_native_keeps_only_scored_data_fields() -> None:
    """A stored payload with a key atroposlib's ``ScoredData`` does not have (written by an
    older API) still leases: the typed model has no place for it."""
    prepared = atropos_wire.prepare(msgspec.Raw(json.dumps(item()).encode()), "zeros")
    payload = json.loads(prepared.payload)
    payload["unknown_key"] = 1
    g = ScoredGroup.model_validate_json(to_native(json.dumps(payload), "g", "toy", 0))
    assert g.atropos == AtroposFields()


# -- per sequence ------------------------------------------------------------------------------


def test_sequence_views() -> None:
    g = ScoredGroup.model_validate_json(native_json(EVERYTHING))
    assert g.atropos.sequence(1) == AtroposSequence(
        advantages=EVERYTHING["advantages"][1],
        ref_logprobs=EVERYTHING["ref_logprobs"][1],
        logprobs_missing=True,
        zero_advantage=True,
    )
    assert g.atropos.sequence(0).zero_advantage is False
    assert AtroposFields().sequence(0) == NATIVE == AtroposSequence()


# -- the checks, each naming the position ------------------------------------------------------


def group_of(**kw) -> ScoredGroup:
    return ScoredGroup.model_validate_json(native_json(item(**kw)))


@pytest.mark.parametrize(
    ("fields", "method", "expected"),
    [
        (
            {"masks": [[-100] * 4 + [20, 21, 22], [-100] * 4 + [30, 31, 99, 33]]},
            "misalignment",
            "masks[1][6] = 99 but tokens[1][6] = 32: a trained position's label",
        ),
        (
            {"inference_logprobs": [[0.0] * 7, [0.0] * 4 + [-1.0, -1.0, -1.0, 1.0]]},
            "misalignment",
            "inference_logprobs[1][7] = 1 at a trained position (masks[1][7] = 33)",
        ),
        (
            {"advantages": [[0.0] * 7]},
            "shape_problem",
            "advantages has 1 rows, the group 2 sequences",
        ),
        (
            {"advantages": [[0.0] * 7, [0.0] * 3]},
            "shape_problem",
            "advantages[1] has 3 values, tokens[1] has 8: per-token advantages must be aligned",
        ),
        (
            {"ref_logprobs": [[0.0] * 6, [0.0] * 8]},
            "shape_problem",
            "ref_logprobs[0] has 6 values, tokens[0] has 7",
        ),
        (
            {"overrides": [{}]},
            "shape_problem",
            "overrides has 1 entries, the group 2 sequences",
        ),
    ],
)
def test_each_check_names_the_position(fields: dict, method: str, expected: str) -> None:
    g = group_of()
    logprobs = fields.pop("inference_logprobs", None)
    if logprobs is not None:  # the logprobs are the sequences'
        seqs = [
            s.model_copy(update={"logprobs": lp})
            for s, lp in zip(g.sequences, logprobs, strict=True)
        ]
        g = g.model_copy(update={"sequences": seqs})
    atropos = g.atropos.model_copy(update=fields)
    reason = getattr(atropos, method)(g.sequences)
    assert reason is not None and reason.startswith(expected), reason
    refused = refusal(g.model_copy(update={"atropos": atropos}), GrpoConfig(temperature=1.0))
    assert refused == reason  # what the trainer refuses the group with at lease time


def test_a_non_finite_row_is_refused() -> None:
    g = group_of()
    rows = [[0.0] * 7, [0.0] * 7 + [math.nan]]
    atropos = g.atropos.model_copy(update={"ref_logprobs": rows})
    assert atropos.shape_problem(g.sequences) == (
        "ref_logprobs[1] has a value that is not a finite number"
    )


def test_missing_logprobs_are_not_checked_and_aligned_groups_pass() -> None:
    placeholders = [[1.0] * 7, [1.0] * 8]  # would be refused were they the sampler's
    g = group_of()
    seqs = [
        s.model_copy(update={"logprobs": lp})
        for s, lp in zip(g.sequences, placeholders, strict=True)
    ]
    missing = AtroposFields(inference_logprobs_missing=True)
    assert missing.misalignment(seqs) is None
    assert AtroposFields().misalignment(seqs).startswith("inference_logprobs[0][4] = 1")
    ok = group_of(advantages=[[0.0] * 7, [1.0] * 8], overrides=[{}, {}])
    assert ok.atropos.misalignment(ok.sequences) is None
    assert ok.atropos.shape_problem(ok.sequences) is None


def test_a_native_push_of_the_old_form_is_stored_in_the_new(tmp_path: Path) -> None:
    """``POST /groups`` with ``extras.atropos`` (a dump pushed again): stored, and leased, with
    the fields in ``atropos``; a malformed one is a 422 naming it, never a 500."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.config import ApiConfig

    converted = native_json(EVERYTHING)
    with TestClient(create_app(ApiConfig(db_path=tmp_path / "api.sqlite"))) as client:
        bad = json.loads(old_form(converted)) | {"group_id": "bad"}
        bad["extras"]["atropos"]["env_id"] = "three"
        r = client.post("/groups", json={"groups": [bad]})
        assert r.status_code == 422 and "extras.atropos.env_id" in r.text
        r = client.post("/groups", json={"groups": [json.loads(old_form(converted))]})
        assert r.json()["accepted"] == 1
        lease = client.post("/batches/lease", json={"max_sequences": 2}).json()
    (served,) = lease["groups"]
    assert served["extras"] == {} and served["atropos"] == json.loads(converted)["atropos"]

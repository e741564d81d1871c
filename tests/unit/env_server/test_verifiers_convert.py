"""A verifiers branch -> ScoredSequence (env_server/verifiers/convert.py) and the proxy's
record of a generate exchange (proxy.py): exact tokens, interleaved masks, logprobs under
mask 0, each sampled run checked against what the inference server returned, every refusal."""

from __future__ import annotations

import pytest

from api.protocol import ScoredGroup
from env_server.verifiers.convert import (
    REFUSALS,
    Refused,
    Turn,
    branch_to_sequence,
    group_version,
    index_turns,
    sampled_runs,
)
from env_server.verifiers.proxy import add_token_placeholders, parse_turn

pytestmark = pytest.mark.unit

# a two-turn episode: prompt, sampled turn, env reply, sampled turn
PROMPT, TURN1, REPLY, TURN2 = [1, 10, 11, 2], [20, 21, 2], [1, 12, 2], [22, 2]
TOKENS = PROMPT + TURN1 + REPLY + TURN2
MASK = [False] * 4 + [True] * 3 + [False] * 3 + [True] * 2
LOGPROBS = [0.0] * 4 + [-0.5, -0.25, -0.125] + [0.0] * 3 + [-1.0, -2.0]


def _turns(v1: int | None = 3, v2: int | None = 4) -> dict:
    return index_turns(
        [
            Turn(tuple(PROMPT), tuple(TURN1), (-0.5, -0.25, -0.125), v1),
            Turn(tuple(PROMPT + TURN1 + REPLY), tuple(TURN2), (-1.0, -2.0), v2),
        ]
    )


def test_multi_turn_branch_keeps_tokens_and_interleaves_the_mask() -> None:
    conv = branch_to_sequence(TOKENS, MASK, LOGPROBS, 0.75, None, _turns())
    seq = conv.sequence
    assert seq["tokens"] == TOKENS
    assert seq["mask"] == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    assert seq["logprobs"] == LOGPROBS and seq["score"] == 0.75
    assert "advantages" not in seq
    assert conv.runs == [(4, 7), (10, 12)]
    assert conv.versions == [3, 4] and group_version(conv.versions, 0) == 3
    group = ScoredGroup(group_id="g", env="v", policy_version=3, sequences=[seq, seq])
    assert group.sequences[0].tokens == TOKENS


def test_env_advantages_travel_per_token() -> None:
    adv = [0.0] * 4 + [1.0] * 3 + [0.0] * 3 + [0.5] * 2
    seq = branch_to_sequence(TOKENS, MASK, LOGPROBS, 1.0, adv, _turns()).sequence
    assert seq["advantages"] == adv


def test_unknown_versions_fall_back_to_the_api_version() -> None:
    conv = branch_to_sequence(TOKENS, MASK, LOGPROBS, 1.0, None, _turns(None, None))
    assert conv.versions == [None, None] and group_version(conv.versions, 7) == 7


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"token_ids": []}, "no_tokens"),
        ({"token_ids": None}, "no_tokens"),
        ({"mask": MASK[:-1]}, "lengths"),
        ({"logprobs": LOGPROBS + [0.0]}, "lengths"),
        ({"advantages": [0.0]}, "lengths"),
        ({"mask": [False] * len(MASK)}, "no_sampled"),
        ({"logprobs": [0.0] * 4 + [float("nan")] + LOGPROBS[5:]}, "bad_logprob"),
        ({"logprobs": [-1.0] + LOGPROBS[1:]}, "bad_logprob"),
        ({"token_ids": [-1] + TOKENS[1:]}, "bad_token"),
        ({"score": float("inf")}, "no_reward"),
        # a sampled token vLLM did not return, and a prefix that is not what it was sent
        ({"token_ids": PROMPT + [20, 99, 2] + REPLY + TURN2}, "not_sampled"),
        ({"token_ids": [1, 10, 13, 2] + TURN1 + REPLY + TURN2}, "not_sampled"),
        # an env reply re-rendered differently from the prompt vLLM saw for turn 2
        ({"token_ids": PROMPT + TURN1 + [1, 14, 2] + TURN2}, "not_sampled"),
    ],
)
def test_inconsistent_branches_are_refused(kwargs: dict, code: str) -> None:
    args = {"token_ids": TOKENS, "mask": MASK, "logprobs": LOGPROBS, "score": 1.0}
    args["advantages"] = None
    args.update(kwargs)
    with pytest.raises(Refused) as e:
        branch_to_sequence(**args, turns=_turns())
    assert e.value.code == code and code in REFUSALS


def test_sampled_runs() -> None:
    assert sampled_runs([]) == []
    assert sampled_runs([1, 1, 0, 1]) == [(0, 2), (3, 4)]
    assert sampled_runs([0, 0]) == []


def test_proxy_records_the_exchange_and_adds_renderers_token_key() -> None:
    response = {
        "choices": [
            {
                "token_ids": [5, 6],
                "logprobs": {
                    "content": [
                        {"token_id": 5, "logprob": -0.1, "top_logprobs": [{"token_id": 5}]},
                        {"token_id": 6, "logprob": -0.2},
                    ]
                },
            }
        ]
    }
    turn = parse_turn(
        {"token_ids": [1, 2]}, response, {"X-Weight-Version": "4", "X-Session-ID": "t1"}
    )
    assert turn == Turn((1, 2), (5, 6), (-0.1, -0.2), 4, "t1")
    assert add_token_placeholders(response)
    content = response["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["token_id:5", "token_id:6"]
    assert content[0]["top_logprobs"][0]["token"] == "token_id:5"
    assert not add_token_placeholders(response)  # already there: unchanged
    assert parse_turn({"token_ids": [1]}, {"error": "x"}, {}) is None

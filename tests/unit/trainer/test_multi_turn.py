"""Multi-turn episodes in the data contract and the trainer's bookkeeping: a sequence is the
prompt, then each model turn (mask 1, with vLLM's logprobs) and each environment reply
(mask 0), exactly as sampled. The loss's equality with padded rows on such episodes is in
tests/unit/trainer/test_prefix_tree.py; these check the fields around it: the environment's own
per-token advantages, the count and reason for an episode over ``max_seq_len``, the model-turn
count, and how the rollout log shows an episode."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from api.protocol import ScoredGroup, ScoredSequence
from trainer.batch import flatten_groups, turns
from trainer.rollout_log import rollout_row

pytestmark = pytest.mark.unit

PROMPT, TURN1, REPLY, TURN2 = [5, 6, 7], [10, 11], [20, 21, 22], [12, 13, 14]


def episode(**kw) -> dict:
    tokens = PROMPT + TURN1 + REPLY + TURN2
    mask = [0] * 3 + [1] * 2 + [0] * 3 + [1] * 3
    logprobs = [0.0] * 3 + [-0.5, -0.25] + [0.0] * 3 + [-1.0, -2.0, -0.125]
    return {"tokens": tokens, "mask": mask, "logprobs": logprobs, "score": 1.0, **kw}


def group(*seqs: dict) -> ScoredGroup:
    return ScoredGroup.model_validate(
        {"group_id": "g", "env": "game", "policy_version": 3, "sequences": list(seqs)}
    )


def test_turns_counts_runs_of_sampled_tokens() -> None:
    assert turns(episode()["mask"]) == 2
    assert turns([0, 0, 1, 1, 1]) == 1
    assert turns([1, 0, 1, 0, 1]) == 3
    assert turns([0, 0]) == 0


def test_per_token_advantages_must_align_and_be_finite() -> None:
    adv = [0.0] * 3 + [1.0, 1.0] + [0.0] * 3 + [-0.5] * 3
    assert ScoredSequence.model_validate(episode(advantages=adv)).advantages == adv
    with pytest.raises(ValidationError, match="advantages has length 10, tokens has 11"):
        ScoredSequence.model_validate(episode(advantages=adv[:-1]))
    with pytest.raises(ValidationError, match=r"advantages\[4\] is not finite"):
        ScoredSequence.model_validate(episode(advantages=adv[:4] + [float("nan")] + adv[5:]))


def test_the_trainer_takes_the_environments_advantages_and_the_tokens_as_sent() -> None:
    adv = [0.0] * 3 + [2.0, 2.0] + [0.0] * 3 + [-1.0] * 3
    items, dropped = flatten_groups([group(episode(advantages=adv), episode(score=0.0))], 64)
    assert dropped == 0
    assert items[0].advantages == adv and items[1].advantages is None
    sent = episode()
    for item in items:  # nothing re-rendered, nothing moved
        assert (item.tokens, item.mask, item.logprobs) == (
            sent["tokens"],
            sent["mask"],
            sent["logprobs"],
        )


def test_an_episode_over_max_seq_len_is_kept_whole_untrained_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    short = {**episode(), "tokens": PROMPT + TURN1, "mask": [0, 0, 0, 1, 1]}
    short["logprobs"] = [0.0] * 3 + [-0.5, -0.25]
    with caplog.at_level(logging.WARNING, logger="trainer.batch"):
        items, dropped = flatten_groups([group(episode(), short)], max_seq_len=8)
    assert dropped == 0
    assert [i.trainable for i in items] == [False, True]
    assert len(items[0].tokens) == 11  # not cut: its logprobs still align
    assert "1 of 2 sequences are longer than max_seq_len 8 (lengths [11])" in caplog.text


class _Tokenizer:
    """Decodes ids as ``<id>`` words; special ids (< 8) dropped when asked to skip them."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"<{i}>" for i in ids if not (skip_special_tokens and i < 8))


def test_the_rollout_log_shows_a_whole_episode_with_its_turns() -> None:
    row = rollout_row(group(episode()), 0, step=2, tokenizer=_Tokenizer())
    assert row["turns"] == 2
    assert row["prompt_tail"] == "<5> <6> <7>"
    # the model's turns and the environment's reply between them, in order
    assert row["completion"] == "<10> <11> <20> <21> <22> <12> <13> <14>"


def test_an_atropos_trainer_leasing_a_native_episode_gets_its_advantages() -> None:
    import json

    from api.atropos_convert import from_native

    adv = [0.0] * 3 + [2.0, 2.0] + [0.0] * 3 + [-1.0] * 3
    both = group(episode(advantages=adv), episode(advantages=[0.5] * 11))
    out = json.loads(from_native(both.model_dump_json()))
    assert out["advantages"] == [adv, [0.5] * 11]
    assert out["masks"][0] == [-100] * 3 + TURN1 + [-100] * 3 + TURN2  # the turns, in place
    one = group(episode(advantages=adv), episode())  # Atropos has no per-sequence None
    assert json.loads(from_native(one.model_dump_json()))["advantages"] is None

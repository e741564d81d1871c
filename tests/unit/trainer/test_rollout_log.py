"""Rollout samples: the env's scored groups carry what its reward saw (``extras.rollouts``),
the trainer samples a few completions per step into ``rollouts.jsonl`` and TensorBoard text.
Groups are built by env_server.rollout.build_group on a real tokenizer and real rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.protocol import ScoredGroup
from env_server.data.corpus import iter_corpus_texts
from env_server.data.dataset import build_dataset
from env_server.inference import Completion, CompletionBatch
from env_server.prompts import format_target
from env_server.reward import RewardConfig
from env_server.rollout import build_group, prompt_ids
from trainer.metrics import MetricsLogger
from trainer.rollout_log import (
    PROMPT_TAIL_CHARS,
    RolloutLog,
    batch_format_rate,
    markdown,
    sample_rollouts,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.tiny_model import train_tokenizer

    return train_tokenizer(iter_corpus_texts(num_sessions=40, seed=0), 2048)


@pytest.fixture(scope="module")
def groups(tokenizer) -> list[ScoredGroup]:
    """Two groups of two completions each: one right answer, one that is not JSON."""
    rows = build_dataset(num_sessions=40, seed=0)["train"].to_list()
    out = []
    for version, row in ((3, rows[5]), (4, rows[9])):
        gold = json.loads(row["action"])
        prompt = prompt_ids(row, tokenizer, max_prompt_tokens=512, latest_only=False)
        good = tokenizer.encode(format_target(row["rationale"], gold), add_special_tokens=False)
        bad = tokenizer.encode("I think I'd click something", add_special_tokens=False)
        batch = CompletionBatch(
            prompt_ids=prompt,
            completions=[
                Completion(tokenizer.decode(good), good, [-0.5] * len(good), "stop"),
                Completion(tokenizer.decode(bad), bad, [-2.0] * len(bad), "stop"),
            ],
            weight_version=version,
        )
        group = build_group(row, batch, tokenizer, RewardConfig(), policy_version=version)
        out.append(ScoredGroup.model_validate_json(json.dumps(group)))  # as the trainer gets it
    return out


def test_groups_carry_what_the_reward_saw(groups) -> None:
    g = groups[0]
    gold = json.loads(g.extras["gold"]["action"])
    good, bad = g.extras["rollouts"]
    assert len(g.extras["rollouts"]) == len(g.sequences)
    assert good["action"] == gold and good["error"] is None and good["exact"] is True
    assert sum(good["reward"].values()) == pytest.approx(g.sequences[0].score)
    assert bad["action"] is None and bad["error"] and bad["exact"] is False
    assert sum(bad["reward"].values()) == g.sequences[1].score == 0.0


def test_sample_rollouts_decodes_and_labels(groups, tokenizer) -> None:
    rows = sample_rollouts(groups, step=7, k=10, tokenizer=tokenizer)
    assert len(rows) == 4  # k larger than the batch: every completion, in batch order
    assert [r["policy_version"] for r in rows] == [3, 3, 4, 4]
    assert all(r["step"] == 7 for r in rows)
    good, bad = rows[0], rows[1]
    assert good["completion"].startswith("{") and good["valid"] and good["exact"]
    assert good["action"] == good["gold_action"] and good["reward"]["format"] == 0.5
    assert bad["completion"] == "I think I'd click something"
    assert bad["valid"] is False and bad["action"] is None and bad["error"]
    assert 0 < len(good["prompt_tail"]) <= PROMPT_TAIL_CHARS
    assert good["prompt_tail"].rstrip().endswith("assistant")  # the chat template's last turn
    # seeded by step: the same step samples the same completions
    assert sample_rollouts(groups, 8, 2, tokenizer) == sample_rollouts(groups, 8, 2, tokenizer)
    assert len(sample_rollouts(groups, 8, 2, tokenizer)) == 2


def test_groups_of_another_env_still_sample(groups, tokenizer) -> None:
    """No extras (an Atropos env): the texts are decoded, the reward details are null."""
    bare = [g.model_copy(update={"extras": {}}) for g in groups]
    row = sample_rollouts(bare, 1, 1, tokenizer)[0]
    assert row["completion"] and row["action"] is None and row["reward"] is None
    assert row["valid"] is None and row["gold_action"] is None


def test_batch_format_rate(groups) -> None:
    assert batch_format_rate(groups) == {"format_rate": 0.5}
    assert batch_format_rate([g.model_copy(update={"metrics": {}}) for g in groups]) == {}


def test_rollout_log_writes_jsonl_and_tensorboard_text(groups, tokenizer, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLogger(tmp_path / "metrics.jsonl", tb_dir=tmp_path / "tb")
    log = RolloutLog(tmp_path / "rollouts.jsonl", 3, tokenizer, metrics)
    log.record(1, groups)
    log.record(2, groups)
    metrics.close()
    rows = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("rollouts/text_summary")
    assert [e.step for e in texts] == [1, 2]
    shown = texts[0].tensor_proto.string_val[0].decode()
    assert shown == markdown([r for r in rows if r["step"] == 1])
    assert "completion:" in shown and "gold `" in shown


def test_zero_samples_writes_nothing(groups, tokenizer, tmp_path: Path) -> None:
    metrics = MetricsLogger(tmp_path / "metrics.jsonl")
    assert RolloutLog(tmp_path / "r.jsonl", 0, tokenizer, metrics).record(1, groups) == []
    metrics.close()
    assert not (tmp_path / "r.jsonl").exists()

"""From a dataset row to a scored group (the data contract in docs/INTERFACES.md).

tokens   = prompt ids + completion ids
mask     = 0 on the prompt, 1 on every completion token (EOS included: stopping is learned)
logprobs = 0.0 on the prompt, the inference server's sampled-token logprobs after it
spans.rationale = 1 on completion tokens that carry the rationale string's characters
score    = the Shop-R1 reward of the completion against the row's gold action
extras.gold = {"rationale", "action"} of the row (the human target; used by trainer/gail/)
extras.row = {"session_id", "step"}: which dataset row the prompt was built from
extras.rollouts = per sequence, what the reward saw: {"action": parsed action or None,
                  "error": format failure or None, "exact": bool, "reward": {registry term:
                  credit}} (the trainer's rollout samples, trainer/rollout_log.py)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from env_server.inference import Completion, CompletionBatch
from env_server.prompts import build_messages
from env_server.reward import ParsedOutput, RewardBreakdown, RewardConfig, parse_output, score
from env_server.sessions import TURNS, session_prompt_ids

ENV_NAME = "shop_r1"


def prompt_ids(
    row: Mapping[str, Any], tokenizer: Any, max_prompt_tokens: int | None, latest_only: bool
) -> list[int]:
    """Chat-templated prompt ids of a row, the context fitted to ``max_prompt_tokens``: the
    session as one conversation when the row carries its earlier turns
    (``env_server.sessions.as_episodes``), else the step form (``env_server.prompts``)."""
    if TURNS in row:
        if latest_only:
            raise ValueError("latest_only shows one page; it does not apply to session episodes")
        return session_prompt_ids(row, tokenizer, max_prompt_tokens)

    def render(budget: int | None) -> list[int]:
        msgs = build_messages(row, tokenizer, budget, latest_only)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    if max_prompt_tokens is None:
        return render(None)
    # The budget counts message contents; the chat template's markers (and merges across
    # boundaries) add a few tokens, so measure the real prompt and shrink until it fits.
    budget = max_prompt_tokens - 16
    for _ in range(4):
        ids = render(budget)
        if len(ids) <= max_prompt_tokens:
            return ids
        budget -= len(ids) - max_prompt_tokens
    raise ValueError(f"cannot fit {row.get('session_id')} into {max_prompt_tokens} tokens")


def token_char_ends(tokenizer: Any, ids: list[int]) -> list[int]:
    """End offset, in ``decode(ids)``, of the text each token completes.

    Decoding prefixes (not single tokens) handles byte-level pieces of one character: the
    character is attributed to the token that completes it.
    """
    return [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]


def rationale_mask(tokenizer: Any, ids: list[int]) -> list[int]:
    """1 on completion tokens overlapping the rationale string's content, else 0."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    parsed = parse_output(text)
    if not isinstance(parsed, ParsedOutput):
        return [0] * len(ids)
    start, end = parsed.rationale_span
    mask, prev = [], 0
    for e in token_char_ends(tokenizer, ids):
        mask.append(1 if prev < end and e > start else 0)  # token covers chars [prev, e)
        prev = e
    return mask


def rollout_record(text: str, r: RewardBreakdown) -> dict[str, Any]:
    """What the reward saw in one completion: the parsed action (None when the format check
    failed, ``error`` says why), whether it matches the gold action exactly, and the credit of
    every reward term (they sum to the score)."""
    parsed = parse_output(text) if r.valid else None
    return {
        "action": parsed.action if isinstance(parsed, ParsedOutput) else None,
        "error": r.failure,
        "exact": r.exact_match,
        "reward": dict(r.components),
    }


def build_sequence(
    prompt: list[int],
    completion: Completion,
    gold: Mapping[str, Any],
    tokenizer: Any,
    reward: RewardConfig,
) -> tuple[dict[str, Any], RewardBreakdown]:
    r = score(completion.text, dict(gold), reward)
    n_p, n_c = len(prompt), len(completion.token_ids)
    seq = {
        "tokens": prompt + completion.token_ids,
        "mask": [0] * n_p + [1] * n_c,
        "logprobs": [0.0] * n_p + completion.logprobs,
        "score": r.total,
        "spans": {"rationale": [0] * n_p + rationale_mask(tokenizer, completion.token_ids)},
    }
    return seq, r


def group_metrics(
    breakdowns: list[RewardBreakdown], completions: list[Completion]
) -> dict[str, float]:
    """Means over the group of every reward component, plus lengths and exact match."""
    per_completion = [b.metrics() for b in breakdowns]  # asdict is costly: once per completion
    out = {k: sum(m[k] for m in per_completion) / len(per_completion) for k in per_completion[0]}
    out["completion_tokens"] = sum(len(c.token_ids) for c in completions) / len(completions)
    out["truncated"] = sum(c.finish_reason == "length" for c in completions) / len(completions)
    return out


def build_group(
    row: Mapping[str, Any],
    batch: CompletionBatch,
    tokenizer: Any,
    reward: RewardConfig,
    policy_version: int,
    score_ramp: float = 0.0,
) -> dict[str, Any]:
    """The scored group of one prompt's completions (``score_ramp``: a test's spread of the
    scores, ``EnvConfig.score_ramp``)."""
    gold = json.loads(row["action"])
    pairs = [
        build_sequence(batch.prompt_ids, c, gold, tokenizer, reward) for c in batch.completions
    ]
    breakdowns = [b for _, b in pairs]
    metrics = group_metrics(breakdowns, batch.completions)
    records = [
        rollout_record(c.text, b) for c, b in zip(batch.completions, breakdowns, strict=True)
    ]
    if score_ramp:
        for i, (seq, record) in enumerate(zip([s for s, _ in pairs], records, strict=True)):
            seq["score"] += i * score_ramp
            record["reward"]["score_ramp"] = i * score_ramp  # the terms still sum to the score
    return {
        "group_id": str(uuid.uuid4()),
        "env": ENV_NAME,
        "policy_version": policy_version,
        "sequences": [s for s, _ in pairs],
        "metrics": metrics,
        # The human target of this prompt: the trainer's optional discriminator reward
        # (trainer/gail/, docs/GAIL.md) learns to tell it from the policy's completions.
        "extras": {
            "gold": {"rationale": row["rationale"], "action": row["action"]},
            # Which dataset row this is (analyses join it back, e.g. to its page kind).
            "row": {"session_id": row.get("session_id"), "step": row.get("step")},
            # What the reward saw in each completion, for the trainer's rollout samples.
            "rollouts": records,
        },
    }

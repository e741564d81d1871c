"""The prompts and the reward TRL's side of ``bench/peers/peer_trl.py`` trains on: this stack's own
code, so both sides see the same thing.

- Prompts: Shop-R1 train rows in the order the env service draws them (``cycle_rows`` with
  the env's seed), each chat-templated and fitted to ``max_prompt_tokens`` by
  ``env_server.rollout.prompt_ids``. TRL takes a text prompt and tokenizes it itself
  (``tokenizer(text=prompts)``), so the prompt handed over is the text of those ids, and every
  row is checked to tokenize back to exactly the env's ids (``prompt_text``).
- Reward: ``env_server.reward.score`` of the completion text against the row's gold action
  under the env's reward config (the preset's variant), the score the env puts in a group.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def rows_in_env_order(
    data_dir: Any, num_sessions: int | None, seed: int, n: int
) -> list[dict[str, Any]]:
    """The first ``n`` train rows the env service would draw (epochs reshuffled as it does)."""
    from env_server.data.dataset import load_or_build
    from env_server.service import cycle_rows

    dataset = load_or_build(data_dir, num_sessions, seed)
    order = cycle_rows(dataset["train"].to_list(), seed)
    return [next(order) for _ in range(n)]


def prompt_text(
    row: Mapping[str, Any], tokenizer: Any, max_prompt_tokens: int | None, latest_only: bool
) -> str:
    """The prompt of ``row`` as text that TRL's tokenizer call turns into exactly the ids the
    env sends vLLM (``prompt_ids``); raises if it would not."""
    from env_server.rollout import prompt_ids

    ids = prompt_ids(row, tokenizer, max_prompt_tokens, latest_only)
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    again = list(tokenizer(text=[text])["input_ids"][0])  # what GRPOTrainer does with a str
    if again != ids:
        raise ValueError(
            f"row {row.get('session_id')}/{row.get('step')}: the prompt text tokenizes to "
            f"{len(again)} ids, not the env's {len(ids)} (first difference at "
            f"{next((i for i, (a, b) in enumerate(zip(again, ids, strict=False)) if a != b), -1)})"
        )
    return text


def trl_rows(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    max_prompt_tokens: int | None,
    latest_only: bool,
) -> list[dict[str, Any]]:
    """TRL dataset rows: ``prompt`` (text, see ``prompt_text``) and ``gold`` (the row's gold
    action, JSON), which TRL hands the reward function as a keyword column."""
    return [
        {
            "prompt": prompt_text(r, tokenizer, max_prompt_tokens, latest_only),
            "gold": r["action"],
            "session_id": str(r["session_id"]),
            "step": int(r["step"]),
        }
        for r in rows
    ]


class ShopR1Reward:
    """TRL reward function: the env's Shop-R1 score of each completion against its row's gold
    action (``reward``: the env's ``reward_config()``, e.g. the preset's ``no_dars``)."""

    __name__ = "shop_r1"

    def __init__(self, reward: Any) -> None:
        self.reward = reward

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], gold: Sequence[str], **_: Any
    ) -> list[float]:
        from env_server.reward import score

        return [
            score(text, json.loads(g), self.reward).total
            for text, g in zip(completions, gold, strict=True)
        ]

"""A sample of each GRPO step's rollouts, kept where people look: ``rollouts.jsonl`` in the run
(``<save_path>/rollouts.jsonl``), TensorBoard text (tag ``rollouts``) and a W&B table.

One row per sampled completion::

    {"step": 12, "policy_version": 11, "group_id": "...", "score": 0.8,
     "prompt_tail": "...last characters of the prompt...", "completion": "{...}",
     "action": {"type": "click", "name": "..."} | null, "error": null | "not JSON ...",
     "gold_action": {"type": "click", "name": "..."}, "reward": {"format": 0.5, ...},
     "valid": true, "exact": false, "turns": 1}

``step`` is the trainer step that trained on it, ``policy_version`` the weights that sampled
it. The texts are decoded from the sequence's tokens (prompt = before the first sampled token,
completion = from there to the end: in a multi-turn episode the model's turns and the
environment's replies between them, with the chat template's markers, and ``turns`` the number
of model turns), so any environment's groups can be sampled; ``action``, ``error``, ``exact`` and ``reward`` come
from the group's ``extras.rollouts`` (what the env's reward saw, env_server/rollout.py) and
``gold_action`` from ``extras.gold``: null when an environment does not send them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from api.protocol import ScoredGroup
from trainer.batch import turns
from trainer.metrics import MetricsLogger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_TAIL_CHARS = 600
"""How much of the prompt's end a sample keeps (the current page and the question)."""
COLUMNS = (
    "step",
    "policy_version",
    "score",
    "action",
    "gold_action",
    "error",
    "completion",
    "prompt_tail",
    "reward",
)
"""Columns of the W&B table, in order."""
FENCE = "`" * 3


class RolloutRow(TypedDict):
    """One sampled completion (the module docstring's format)."""

    step: int
    policy_version: int
    group_id: str
    score: float
    prompt_tail: str
    completion: str
    action: dict[str, Any] | None
    error: str | None
    gold_action: Any
    """``extras.gold.action`` decoded from its JSON string (as sent when it does not parse)."""
    reward: dict[str, float] | None
    valid: bool | None
    exact: bool | None
    turns: int
    """Model turns in the episode (runs of sampled tokens): 1 for a single completion."""


def _json_field(value: Any) -> Any:
    """A JSON string (the data contract's ``gold.action``) decoded; anything else as is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def sample_rollouts(
    groups: Sequence[ScoredGroup],
    step: int,
    k: int,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
) -> list[RolloutRow]:
    """``k`` completions drawn uniformly (seeded by ``seed`` and ``step``) from the groups of a
    step, as the rows described in the module docstring, in batch order."""
    where = [(g, s) for g, grp in enumerate(groups) for s in range(len(grp.sequences))]
    picked = sorted(random.Random(f"rollouts-{seed}-{step}").sample(where, min(k, len(where))))
    return [rollout_row(groups[g], s, step, tokenizer) for g, s in picked]


def rollout_row(
    group: ScoredGroup, s: int, step: int, tokenizer: PreTrainedTokenizerBase
) -> RolloutRow:
    """The row of completion ``s`` of ``group`` (the module docstring's format)."""
    seq = group.sequences[s]
    first = seq.mask.index(1) if 1 in seq.mask else len(seq.mask)
    prompt, episode = seq.tokens[:first], seq.tokens[first:]
    n_turns = turns(seq.mask)
    extras = group.extras
    seen = extras.get("rollouts") or []
    seen = seen[s] if s < len(seen) and isinstance(seen[s], Mapping) else {}
    reward = seen.get("reward")
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
    return {
        "step": step,
        "policy_version": group.policy_version,
        "group_id": group.group_id,
        "score": seq.score,
        "prompt_tail": prompt_text[-PROMPT_TAIL_CHARS:],
        # a multi-turn episode keeps its chat markers, so the turns stay apart
        "completion": tokenizer.decode(episode, skip_special_tokens=n_turns <= 1),
        "turns": n_turns,
        "action": seen.get("action"),
        "error": seen.get("error"),
        "gold_action": _json_field((extras.get("gold") or {}).get("action")),
        "reward": reward,
        "valid": None if reward is None else seen.get("action") is not None,
        "exact": seen.get("exact"),
    }


def batch_format_rate(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """``{"format_rate": ...}``: the share of the batch's completions with a valid format (the
    groups' ``metrics.valid``, weighted by group size); empty when no group reports it."""
    num = den = 0.0
    for group in groups:
        valid = group.metrics.get("valid")
        n = len(group.sequences)
        if isinstance(valid, int | float):
            num, den = num + float(valid) * n, den + n
    return {"format_rate": num / den} if den else {}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _fenced(text: str) -> str:
    """``text`` in a fenced block (a fence inside it is defused, so it cannot end the block)."""
    inner = text.replace(FENCE, "'" * 3)
    return f"{FENCE}\n{inner}\n{FENCE}"


def markdown(rows: Sequence[RolloutRow]) -> str:
    """The rows as one TensorBoard text entry (markdown: a heading and fenced texts per row)."""
    parts = []
    for r in rows:
        verdict = "exact" if r.get("exact") else ("invalid" if r.get("valid") is False else "")
        error = f" error: {r['error']}" if r.get("error") else ""
        lines = [
            f"**policy v{r['policy_version']}, score {r['score']:.3f}** {verdict}  ",
            f"action `{_cell(r.get('action')) or '-'}` "
            f"gold `{_cell(r.get('gold_action')) or '-'}`{error}  ",
            f"reward terms `{_cell(r.get('reward')) or '-'}`",
            "",
            "prompt (end):",
            "",
            _fenced(r["prompt_tail"]),
            "",
            "completion:",
            "",
            _fenced(r["completion"]),
        ]
        parts.append("\n".join(lines))
    return "\n\n---\n\n".join(parts)


class RolloutLog:
    """Writes ``k`` sampled rollouts per step to ``path`` (JSONL, one line per completion,
    appended and closed per step) and hands them to the metrics logger's TensorBoard / W&B
    sinks (``MetricsLogger.log_text`` / ``log_table``)."""

    def __init__(
        self,
        path: Path,
        k: int,
        tokenizer: PreTrainedTokenizerBase,
        metrics: MetricsLogger,
        seed: int = 0,
    ) -> None:
        self.path, self.k, self.tokenizer = path, k, tokenizer
        self.metrics, self.seed = metrics, seed

    def record(self, step: int, groups: Sequence[ScoredGroup]) -> list[RolloutRow]:
        """Sample, write and mirror step ``step``'s rollouts; returns the rows."""
        if self.k <= 0 or not groups:
            return []
        rows = sample_rollouts(groups, step, self.k, self.tokenizer, self.seed)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        self.metrics.log_text("rollouts", markdown(rows), step)
        table = [[_cell(r.get(c)) for c in COLUMNS] for r in rows]
        self.metrics.log_table("rollouts", list(COLUMNS), table, step)
        return rows

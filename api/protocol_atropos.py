"""The fields an Atropos group sends beyond tokens, masks, scores and logprobs, typed: what a
native lease serves in ``ScoredGroup.atropos`` (api/protocol.py; built from the stored
``ScoredData`` by ``api.atropos_convert.to_native``) and the trainer reads by attribute.

The model is as lenient as the Atropos routes' decode (``api.atropos_wire.AtroposItem``), so
a stored group always parses; what the trainer cannot train -- rows not aligned to the
tokens, a trained position that is not what was sampled -- is found by ``misalignment`` and
``shape_problem`` when the trainer leases the group (trainer/atropos_fields.py ``refusal``),
which refuses that group alone, naming the position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

LOGPROB_MAX = 1e-3
"""The largest inference logprob of a trained token still taken for a logprob (``<= 0``, with
room for rounding); ManagedServer's placeholder is ``1.0``."""


def _absent(v: Any) -> bool:
    return v is None


class Sampled(Protocol):
    """What the checks read of a group's sequence (``api.protocol.ScoredSequence``)."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def mask(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...


@dataclass(frozen=True)
class AtroposSequence:
    """The Atropos fields of one sequence of a group, for trainer/batch.py."""

    advantages: list[float] | None = None
    """Per-token advantages, aligned to the tokens (``None``: the group-normalised score)."""
    ref_logprobs: list[float] | None = None
    """Per-token reference logprobs, aligned to the tokens (``None``: the reference model's)."""
    logprobs_missing: bool = False
    """The env sent no inference logprobs (the ones leased are placeholders)."""
    zero_advantage: bool = False
    """``overrides[i].set_advantage_to_zero``."""


NATIVE = AtroposSequence()
"""What a sequence of a native group (no Atropos fields) has of them: nothing."""


class AtroposFields(BaseModel):
    """Atropos ``ScoredData`` fields besides ``tokens``, ``masks``, ``scores`` and
    ``inference_logprobs`` (those are the sequences'), in its order, plus what the conversion
    adds. Per-sequence members have one entry per sequence, in order. A member left out
    (``None``; ``inference_logprobs_missing`` false) is left out of the JSON, as the
    ``extras["atropos"]`` object it replaces did."""

    model_config = ConfigDict(extra="forbid")

    advantages: list[list[float]] | None = Field(None, exclude_if=_absent)
    """Per sequence, per token: replace the group-normalised score on that sequence."""
    ref_logprobs: list[list[float]] | None = Field(None, exclude_if=_absent)
    """Per sequence, per token: the KL's reference for that sequence."""
    messages: list[list[dict[str, Any]]] | None = Field(None, exclude_if=_absent)
    """Per sequence: the chat (no effect on training)."""
    generation_params: dict[str, Any] | None = Field(None, exclude_if=_absent)
    """Per group: the sampling parameters (only ``temperature`` is checked)."""
    overrides: list[dict[str, Any]] | None = Field(None, exclude_if=_absent)
    """Per sequence: free-form keys (``set_advantage_to_zero``, ``temperature``, ...)."""
    group_overrides: dict[str, Any] | None = Field(None, exclude_if=_absent)
    """Per group: free-form keys (``group_id``, ``policy_version``: applied by the API)."""
    images: Any | None = Field(None, exclude_if=_absent)
    """Per group: multimodal inputs (refused by the text-only trainer)."""
    env_id: int | None = Field(None, exclude_if=_absent)
    """Per group: the Atropos env that sent it."""
    distill_token_ids: list[list[list[int]]] | None = Field(None, exclude_if=_absent)
    """Per sequence, per token: distillation targets (refused: no distillation loss)."""
    distill_logprobs: list[list[list[float]]] | None = Field(None, exclude_if=_absent)
    """Per sequence, per token: distillation targets (refused: no distillation loss)."""
    masks: list[list[int]] | None = Field(None, exclude_if=_absent)
    """Per sequence: Atropos's labels verbatim, kept only when one is not its token (the
    sequence's 0/1 ``mask`` is ``label != -100``)."""
    inference_logprobs_missing: bool = Field(False, exclude_if=lambda v: not v)
    """Per group: the env sent no inference logprobs; the sequences' are 0.0 placeholders."""

    def sequence(self, i: int) -> AtroposSequence:
        """The fields of sequence ``i`` (its rows; ``None`` where the group sent none)."""
        entry = _row(self.overrides, i) or {}
        return AtroposSequence(
            advantages=_row(self.advantages, i),
            ref_logprobs=_row(self.ref_logprobs, i),
            logprobs_missing=self.inference_logprobs_missing,
            zero_advantage=bool(entry.get("set_advantage_to_zero", False)),
        )

    def misalignment(self, sequences: Sequence[Sampled]) -> str | None:
        """Why the group's trained positions are not what was sampled there, or ``None``.
        Atropos's masks are labels: ``-100`` or the token id itself. The API converts them to
        the 0/1 mask by ``!= -100`` and keeps them verbatim in ``masks`` only when a label is
        another token (api/atropos_convert.py): Atropos's trainer would learn the label, this
        one the token, and neither was sampled there (an env that re-tokenized the chat for
        ``tokens`` but kept ManagedServer's masks). A trained token's inference logprob must
        be a logprob: ManagedServer writes ``1.0`` on prompt positions, and on a completion's
        last tokens when the server answered fewer logprobs than tokens; the importance ratio
        would take it for the sampler's."""
        labels = self.masks
        for i, seq in enumerate(sequences):
            if labels is not None:
                for j, (m, t) in enumerate(zip(labels[i], seq.tokens, strict=False)):
                    if m != -100 and m != t:
                        return (
                            f"masks[{i}][{j}] = {m} but tokens[{i}][{j}] = {t}: a trained "
                            f"position's label must be its token (-100 or the token id), or "
                            f"the sequence trains a token that was not sampled there"
                        )
            if self.inference_logprobs_missing:
                continue
            if max(compress(seq.logprobs, seq.mask), default=-math.inf) <= LOGPROB_MAX:
                continue  # (the common case in C; the position is searched only to name it)
            for j, (m, lp) in enumerate(zip(seq.mask, seq.logprobs, strict=False)):
                if m and lp > LOGPROB_MAX:
                    return (
                        f"inference_logprobs[{i}][{j}] = {lp:g} at a trained position "
                        f"(masks[{i}][{j}] = {seq.tokens[j]}): not a logprob (<= 0); "
                        f"atroposlib's ManagedServer writes 1.0 where the server returned no "
                        f"logprob for a token"
                    )
        return None

    def shape_problem(self, sequences: Sequence[Sampled]) -> str | None:
        """Why the per-token rows (``advantages``, ``ref_logprobs``) or the ``overrides`` do not
        fit the group's sequences (one row or entry per sequence, one finite value per
        token), or ``None``."""
        for name, rows in (("advantages", self.advantages), ("ref_logprobs", self.ref_logprobs)):
            reason = _per_token(name, rows, sequences)
            if reason:
                return reason
        overrides = self.overrides or []
        if len(overrides) not in (0, len(sequences)):
            return f"overrides has {len(overrides)} entries, the group {len(sequences)} sequences"
        return None


def _row(rows: list[Any] | None, i: int) -> Any:
    return rows[i] if rows is not None and i < len(rows) else None


def _per_token(name: str, rows: list[list[float]] | None, seqs: Sequence[Sampled]) -> str | None:
    if rows is None:
        return None
    if len(rows) != len(seqs):
        return f"{name} has {len(rows)} rows, the group {len(seqs)} sequences"
    for i, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
        n = len(seq.tokens)
        if len(row) != n:
            return (
                f"{name}[{i}] has {len(row)} values, tokens[{i}] has {n}: per-token {name} must "
                f"be aligned to tokens (one value per token; prompt positions are ignored)"
            )
        if not all(math.isfinite(x) for x in row):
            return f"{name}[{i}] has a value that is not a finite number"
    return None

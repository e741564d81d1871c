"""What an Atropos group sends beyond tokens, masks and scores, and what the GRPO trainer does
with each field (docs/ATROPOS.md has the table). A group leased natively carries them in
``extras.atropos`` (api/atropos_convert.py ``to_native``).

- applied: ``inference_logprobs`` (recomputed by the trainer's forward pass when the env sent
  none, ``inference_logprobs_missing``: never trained on zeros), ``advantages`` (per token,
  replace the group-normalised score), ``ref_logprobs`` (per token, the KL's reference),
  ``overrides[i].set_advantage_to_zero``; ``group_overrides.group_id`` / ``policy_version``
  (applied by the API);
- checked: a ``temperature`` (``overrides[i]``, ``group_overrides``, ``generation_params``) must
  be the trainer's ``--temperature``: the trainer computes every logprob at one temperature;
- no effect on training: ``messages``, ``env_id``, ``generation_params`` (but its
  temperature), ``group_overrides.group_size`` (atroposlib's and the API's group check);
- refused at lease time, naming the position: a sequence whose trained positions are not
  what was sampled there -- a label (``masks``) that is not its token, or an inference logprob
  that is no logprob (``> 0``: atroposlib's ManagedServer pads a completion the server
  answered too few logprobs for with ``1.0``), see ``misalignment``;
- refused at lease time, with a reason naming the key: ``images`` (a text-only trainer),
  ``distill_token_ids`` / ``distill_logprobs`` (no distillation loss here), ``sft``, and any
  other ``overrides`` / ``group_overrides`` key, unless ``--atropos-metadata-keys`` names it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, Any

from api.protocol import ScoredGroup, ScoredSequence
from trainer.config import GrpoConfig

if TYPE_CHECKING:
    from api.client import ApiClient

log = logging.getLogger(__name__)

API_KEYS = frozenset({"group_id", "policy_version"})
"""``group_overrides`` keys the batching API applies (idempotency key, sampling version)."""
METADATA_KEYS = frozenset({"group_size"})
"""``group_overrides`` keys with no effect on what is trained (atroposlib's BaseEnv and the
API's buffer use ``group_size`` to check a group's size)."""
UNSUPPORTED_FIELDS = {
    "images": "multimodal inputs; this trainer trains text models on the tokens alone",
    "distill_token_ids": "on-policy distillation targets; this trainer has no distillation loss",
    "distill_logprobs": "on-policy distillation targets; this trainer has no distillation loss",
}
TEMPERATURE_TOLERANCE = 1e-6
LOGPROB_MAX = 1e-3
"""The largest inference logprob of a trained token still taken for a logprob (``<= 0``, with
room for rounding); ManagedServer's placeholder is ``1.0``."""


def atropos_extras(group: ScoredGroup) -> dict[str, Any]:
    """The Atropos fields of a leased group (``{}`` for a native group)."""
    return dict(group.extras.get("atropos") or {})


def metadata_keys(cfg: GrpoConfig) -> set[str]:
    return {k.strip() for k in cfg.atropos_metadata_keys.split(",") if k.strip()}


def refusal(group: ScoredGroup, cfg: GrpoConfig) -> str | None:
    """Why the trainer cannot train ``group`` as sent (the reason names the field or key), or
    ``None``. Called at lease time, before anything is trained."""
    extras = atropos_extras(group)
    seqs = group.sequences
    meta = metadata_keys(cfg)
    wants_env_ref = cfg.kl_reference == "env" and cfg.kl_beta > 0
    if wants_env_ref and extras.get("ref_logprobs") is None:
        return (
            "ref_logprobs: kl_reference is 'env' (no reference model) and kl_beta > 0, but the "
            "group sent no ref_logprobs"
        )
    reason = misalignment(group, extras)
    if reason:
        return reason
    for name, why in UNSUPPORTED_FIELDS.items():
        if extras.get(name) is not None and name not in meta:
            return f"{name}: {why} (list it in --atropos-metadata-keys to train without it)"
    for name in ("advantages", "ref_logprobs"):
        reason = _per_token(name, extras.get(name), seqs)
        if reason:
            return reason
    overrides = extras.get("overrides") or []
    if len(overrides) not in (0, len(seqs)):
        return f"overrides has {len(overrides)} entries, the group {len(seqs)} sequences"
    for i, entry in enumerate(overrides):
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            return f"overrides[{i}] must be an object, got {type(entry).__name__}"
        for key, value in entry.items():
            reason = _key(f"overrides[{i}].{key}", key, value, cfg, meta, per_sequence=True)
            if reason:
                return reason
    for key, value in (extras.get("group_overrides") or {}).items():
        if key in API_KEYS:
            continue
        reason = _key(f"group_overrides.{key}", key, value, cfg, meta, per_sequence=False)
        if reason:
            return reason
    params = extras.get("generation_params") or {}
    if isinstance(params, Mapping) and "temperature" in params:
        return _temperature("generation_params.temperature", params["temperature"], cfg)
    return None


def misalignment(group: ScoredGroup, extras: Mapping[str, Any]) -> str | None:
    """Why an Atropos group's trained positions are not what was sampled there, or ``None``.
    Atropos's masks are labels: ``-100`` or the token id itself. The API converts them to the
    0/1 mask by ``!= -100`` and keeps them verbatim in ``extras.atropos.masks`` only when a
    label is another token (api/atropos_convert.py): Atropos's trainer would learn the label,
    this one the token, and neither was sampled there (an env that re-tokenized the chat for
    ``tokens`` but kept ManagedServer's masks). A trained token's inference logprob must be
    a logprob: ManagedServer writes ``1.0`` on prompt positions, and on a completion's last
    tokens when the server answered fewer logprobs than tokens; the importance ratio would
    take it for the sampler's. A native group (no ``extras.atropos``) is not checked."""
    if "atropos" not in group.extras:
        return None
    labels = extras.get("masks")
    missing = extras.get("inference_logprobs_missing", False)
    for i, seq in enumerate(group.sequences):
        if labels is not None:
            for j, (m, t) in enumerate(zip(labels[i], seq.tokens, strict=False)):
                if m != -100 and m != t:
                    return (
                        f"masks[{i}][{j}] = {m} but tokens[{i}][{j}] = {t}: a trained "
                        f"position's label must be its token (-100 or the token id), or the "
                        f"sequence trains a token that was not sampled there"
                    )
        if missing or max(compress(seq.logprobs, seq.mask), default=-math.inf) <= LOGPROB_MAX:
            continue  # (the common case in C; the position is searched only to name it)
        for j, (m, lp) in enumerate(zip(seq.mask, seq.logprobs, strict=False)):
            if m and lp > LOGPROB_MAX:
                return (
                    f"inference_logprobs[{i}][{j}] = {lp:g} at a trained position "
                    f"(masks[{i}][{j}] = {seq.tokens[j]}): not a logprob (<= 0); atroposlib's "
                    f"ManagedServer writes 1.0 where the server returned no logprob for a token"
                )
    return None


def _per_token(name: str, rows: Any, seqs: Sequence[ScoredSequence]) -> str | None:
    if rows is None:
        return None
    if len(rows) != len(seqs):
        return f"{name} has {len(rows)} rows, the group {len(seqs)} sequences"
    for i, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
        n = len(seq.tokens)
        if row is None or len(row) != n:
            got = "none" if row is None else len(row)
            return (
                f"{name}[{i}] has {got} values, tokens[{i}] has {n}: per-token {name} must be "
                f"aligned to tokens (one value per token; prompt positions are ignored)"
            )
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in row):
            return f"{name}[{i}] has a value that is not a finite number"
    return None


def _key(
    where: str, key: str, value: Any, cfg: GrpoConfig, meta: set[str], per_sequence: bool
) -> str | None:
    if key in meta or key in METADATA_KEYS:
        return None
    if key == "set_advantage_to_zero" and per_sequence:
        if isinstance(value, bool):
            return None
        return f"{where} must be true or false, got {value!r}"
    if key == "temperature":
        return _temperature(where, value, cfg)
    if key == "sft":
        return f"{where}: SFT groups are not trained by the GRPO trainer"
    return (
        f"{where}: the trainer does not know what this key changes, so it cannot apply it; "
        f"if it is only metadata, list it in --atropos-metadata-keys"
    )


def _temperature(where: str, value: Any, cfg: GrpoConfig) -> str | None:
    try:
        t = float(value)
    except (TypeError, ValueError):
        return f"{where} must be a number, got {value!r}"
    if abs(t - cfg.temperature) <= TEMPERATURE_TOLERANCE:
        return None
    return (
        f"{where} = {t:g}: sampled at temperature {t:g}, but this trainer computes every "
        f"logprob at --temperature {cfg.temperature:g}; start it with --temperature {t:g} or "
        f"sample at {cfg.temperature:g}"
    )


@dataclass(frozen=True)
class SequenceFields:
    """The Atropos fields of one sequence of a group, for trainer/batch.py."""

    advantages: list[float] | None
    """Per-token advantages, aligned to the tokens (``None``: the group-normalised score)."""
    ref_logprobs: list[float] | None
    """Per-token reference logprobs, aligned to the tokens (``None``: the reference model's)."""
    logprobs_missing: bool
    """The env sent no inference logprobs (the ones leased are placeholders)."""
    zero_advantage: bool
    """``overrides[i].set_advantage_to_zero``."""


def sequence_fields(group: ScoredGroup) -> list[SequenceFields]:
    """The Atropos fields of each sequence of ``group``, in order."""
    n = len(group.sequences)
    extras = atropos_extras(group)
    adv = extras.get("advantages") or [None] * n
    ref = extras.get("ref_logprobs") or [None] * n
    overrides = extras.get("overrides") or [None] * n
    missing = bool(extras.get("inference_logprobs_missing", False))
    out = []
    for i in range(n):
        entry = overrides[i] if i < len(overrides) and isinstance(overrides[i], Mapping) else {}
        out.append(
            SequenceFields(
                advantages=adv[i] if i < len(adv) else None,
                ref_logprobs=ref[i] if i < len(ref) else None,
                logprobs_missing=missing,
                zero_advantage=bool(entry.get("set_advantage_to_zero", False)),
            )
        )
    return out


def refuse(
    api: ApiClient, cfg: GrpoConfig, batch_id: str, groups: list[ScoredGroup]
) -> list[ScoredGroup]:
    """The groups of a leased batch the trainer can train as sent; the others are marked
    ``rejected`` at the API (``POST /batches/{id}/reject``: kept, never served again), each
    logged with the field or key that made it so."""
    reasons = {}
    for g in groups:
        reason = refusal(g, cfg)
        if reason is not None:
            reasons[g.group_id] = reason
            log.error(
                "batch %s: group %s (env %s) refused: %s", batch_id, g.group_id, g.env, reason
            )
    if not reasons:
        return groups
    api.reject(batch_id, reasons)
    return [g for g in groups if g.group_id not in reasons]

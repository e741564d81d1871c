"""What an Atropos group sends beyond tokens, masks and scores, and what the GRPO trainer does
with each field (docs/ATROPOS.md has the table). A group leased natively carries them typed,
in ``group.atropos`` (``api.protocol_atropos.AtroposFields``, built by
api/atropos_convert.py ``to_native``); ``refusal`` checks them once, at lease time, and the
trainer reads them by attribute from there on (``AtroposFields.sequence``).

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
  answered too few logprobs for with ``1.0``), see ``AtroposFields.misalignment``; per-token
  ``advantages`` / ``ref_logprobs`` not aligned to the tokens, ``overrides`` not one per
  sequence (``AtroposFields.shape_problem``);
- refused at lease time, with a reason naming the key: ``images`` (a text-only trainer),
  ``distill_token_ids`` / ``distill_logprobs`` (no distillation loss here), ``sft``, and any
  other ``overrides`` / ``group_overrides`` key, unless ``--atropos-metadata-keys`` names it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from api.protocol import ScoredGroup
from api.protocol_atropos import AtroposFields
from trainer.config import GrpoConfig

if TYPE_CHECKING:
    from api.client import ApiClient

log = logging.getLogger(__name__)

API_KEYS = frozenset({"group_id", "policy_version"})
"""``group_overrides`` keys the batching API applies (idempotency key, sampling version)."""
METADATA_KEYS = frozenset({"group_size"})
"""``group_overrides`` keys with no effect on what is trained (atroposlib's BaseEnv and the
API's buffer use ``group_size`` to check a group's size)."""
_IMAGES = "multimodal inputs; this trainer trains text models on the tokens alone"
_DISTILL = "on-policy distillation targets; this trainer has no distillation loss"
TEMPERATURE_TOLERANCE = 1e-6


def metadata_keys(cfg: GrpoConfig) -> set[str]:
    return set(cfg.atropos_metadata_keys)


def refusal(group: ScoredGroup, cfg: GrpoConfig) -> str | None:
    """Why the trainer cannot train ``group`` as sent (the reason names the field or key), or
    ``None``. Called at lease time, before anything is trained. A native group (no
    ``atropos``) is refused only when ``kl_reference`` is ``env``."""
    fields = group.atropos
    seqs = group.sequences
    meta = metadata_keys(cfg)
    wants_env_ref = cfg.kl_reference == "env" and cfg.kl_beta > 0
    if wants_env_ref and (fields is None or fields.ref_logprobs is None):
        return (
            "ref_logprobs: kl_reference is 'env' (no reference model) and kl_beta > 0, but the "
            "group sent no ref_logprobs"
        )
    if fields is None:
        return None
    reason = fields.misalignment(seqs)
    if reason:
        return reason
    for name, value, why in _unsupported(fields):
        if value is not None and name not in meta:
            return f"{name}: {why} (list it in --atropos-metadata-keys to train without it)"
    reason = fields.shape_problem(seqs)
    if reason:
        return reason
    for i, entry in enumerate(fields.overrides or []):
        for key, value in entry.items():
            reason = _key(f"overrides[{i}].{key}", key, value, cfg, meta, per_sequence=True)
            if reason:
                return reason
    for key, value in (fields.group_overrides or {}).items():
        if key in API_KEYS:
            continue
        reason = _key(f"group_overrides.{key}", key, value, cfg, meta, per_sequence=False)
        if reason:
            return reason
    params = fields.generation_params or {}
    if "temperature" in params:
        return _temperature("generation_params.temperature", params["temperature"], cfg)
    return None


def _unsupported(fields: AtroposFields) -> list[tuple[str, Any, str]]:
    """The fields this trainer cannot apply: (name, what the group sent, why not)."""
    return [
        ("images", fields.images, _IMAGES),
        ("distill_token_ids", fields.distill_token_ids, _DISTILL),
        ("distill_logprobs", fields.distill_logprobs, _DISTILL),
    ]


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

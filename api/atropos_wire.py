"""Atropos groups on the wire: parsing and checking posted ``ScoredData`` (the conversion
between Atropos's shape and the native contract is ``api.atropos_convert``).

Groups posted on the Atropos routes are stored as Atropos JSON (every ``ScoredData`` field,
``distill_token_ids``/``distill_logprobs`` included), re-encoded compactly, and served on
``GET /batch`` verbatim; they are converted to the native contract only when a native lease
serves them. Parsing uses msgspec (typed decoding in C: ~10x cheaper than pydantic on
token lists); each posted group is decoded and checked on its own, so one bad group is
rejected alone with its reason and never takes its neighbours with it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from api.atropos_convert import ATROPOS_FIELDS
from api.protocol import GROUP_ID_MAX, VERSION_MAX

UNSET = msgspec.UNSET


class AtroposItem(msgspec.Struct, forbid_unknown_fields=True):
    """atroposlib 0.4.0's ``ScoredData``. Optional fields left out of the JSON stay ``UNSET``
    (explicit ``null``: ``None``), which lets a posted group be stored as its own bytes with
    only the missing keys added as ``null`` (Atropos serves every field), without encoding
    it again."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None | msgspec.UnsetType = UNSET
    ref_logprobs: list[list[float]] | None | msgspec.UnsetType = UNSET
    messages: list[list[dict[str, Any]]] | None | msgspec.UnsetType = UNSET
    generation_params: dict[str, Any] | None | msgspec.UnsetType = UNSET
    inference_logprobs: list[list[float]] | None | msgspec.UnsetType = UNSET
    overrides: list[dict[str, Any]] | None | msgspec.UnsetType = UNSET
    group_overrides: dict[str, Any] | None | msgspec.UnsetType = UNSET
    images: Any | msgspec.UnsetType = UNSET
    env_id: int | None | msgspec.UnsetType = UNSET
    distill_token_ids: list[list[list[int]]] | None | msgspec.UnsetType = UNSET
    distill_logprobs: list[list[list[float]]] | None | msgspec.UnsetType = UNSET


class AtroposItemLoose(AtroposItem, forbid_unknown_fields=False):
    """The same, ignoring unknown fields (as Atropos's pydantic model does); such a group is
    encoded again without them."""


if AtroposItem.__struct_fields__ != ATROPOS_FIELDS:  # the two lists must name the same fields
    raise ImportError("api.atropos_convert.ATROPOS_FIELDS differs from AtroposItem's fields")
_decode_list = msgspec.json.Decoder(list[msgspec.Raw])
_decode_item = msgspec.json.Decoder(AtroposItem)
_decode_loose = msgspec.json.Decoder(AtroposItemLoose)
_encoder = msgspec.json.Encoder()


def _get(g: AtroposItem, name: str) -> Any:
    """A field's value, ``None`` when it was left out."""
    v = getattr(g, name)
    return None if v is UNSET else v


MissingLogprobs = Literal["reject", "zeros"]


class ItemError(ValueError):
    """One posted group cannot be stored; the message says why."""


@dataclass
class PreparedGroup:
    """A posted group ready for the store."""

    group_id: str
    policy_version: int | None
    """``group_overrides.policy_version``; ``None``: the live version."""
    env_id: int | None
    n_seqs: int
    n_tokens: int
    payload: str


_NOT_DECODED = (ValueError, RecursionError)
"""What the decoders raise for a body that is not JSON: ``msgspec.DecodeError`` and
``json.JSONDecodeError`` (both ``ValueError``s), ``UnicodeDecodeError`` (msgspec, for invalid
UTF-8 inside a string) and ``RecursionError`` (both, for arrays nested too deep)."""


def split_body(raw: bytes) -> list[Any]:
    """A ``/scored_data_list`` body -> its items, each still undecoded (``msgspec.Raw``), or
    decoded by Python's ``json`` when the body uses its non-standard ``NaN``/``Infinity``
    (which atroposlib's ``json.dumps`` writes for a NaN score). Raises ``ItemError`` when
    the body is not a JSON list."""
    try:
        return _decode_list.decode(raw)
    except _NOT_DECODED:
        pass
    try:
        body = json.loads(raw)
    except _NOT_DECODED as e:
        raise ItemError(f"body is not JSON: {e}") from None
    if not isinstance(body, list):
        raise ItemError("body must be a JSON list of groups")
    return body


def decode_one(raw: bytes) -> Any:
    """A ``/scored_data`` body -> the item (``msgspec.Raw``, or Python objects, as above)."""
    try:
        msgspec.json.decode(raw)
        return msgspec.Raw(raw)
    except _NOT_DECODED:
        pass
    try:
        return json.loads(raw)
    except _NOT_DECODED as e:
        raise ItemError(f"body is not JSON: {e}") from None


def prepare(item: Any, missing_logprobs: MissingLogprobs) -> PreparedGroup:
    """Decode and check one group. Checks (beyond Atropos's types): equal numbers of
    tokens/masks/scores (and logprobs, advantages, ...), masks and logprobs as long as their
    tokens, finite numbers, at least one sequence."""
    raw = bytes(item).strip() if isinstance(item, msgspec.Raw) else None
    try:
        try:
            g = _decode_item.decode(raw) if raw is not None else None
        except msgspec.ValidationError:
            raw = None  # unknown fields (or a type error, reported by the loose decode)
            g = _decode_loose.decode(bytes(item))
        if g is None:
            g = msgspec.convert(item, AtroposItemLoose)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ItemError(str(e)) from None
    env_id = _get(g, "env_id")
    if env_id is not None and not 0 <= env_id <= VERSION_MAX:
        raise ItemError(f"env_id must be an integer in 0..{VERSION_MAX} (got {env_id})")
    n = len(g.tokens)
    if n == 0:
        raise ItemError("tokens is empty: a group needs at least one sequence")
    lengths = [len(t) for t in g.tokens]
    if 0 in lengths:
        raise ItemError(f"sequence {lengths.index(0)} has no tokens")
    per_seq = {"masks": g.masks, "scores": g.scores}
    for name in ("inference_logprobs", "advantages", "ref_logprobs", "overrides", "messages"):
        if _get(g, name) is not None:
            per_seq[name] = _get(g, name)
    for name, values in per_seq.items():
        if len(values) != n:
            raise ItemError(
                f"tokens, masks and scores must list the same number of completions "
                f"(tokens {n}, {name} {len(values)})"
            )
    for name in ("masks", "inference_logprobs"):
        values = per_seq.get(name)
        if values is None:
            continue
        for i, (v, length) in enumerate(zip(values, lengths, strict=True)):
            if len(v) != length:
                raise ItemError(f"{name}[{i}] has {len(v)} entries, tokens[{i}] has {length}")
    for seq in _get(g, "messages") or ():
        if any("role" not in m or "content" not in m for m in seq):
            raise ItemError("messages: every message needs 'role' and 'content'")
    if _get(g, "inference_logprobs") is None and missing_logprobs == "reject":
        raise ItemError(
            "inference_logprobs are missing: the trainer's importance ratio needs them "
            "(start the API with --atropos-missing-logprobs zeros to accept such groups)"
        )
    if not isinstance(item, msgspec.Raw):  # Python's json lets NaN/Infinity through
        _check_finite(g)
    if raw is not None:  # the posted bytes, plus the keys it left out
        absent = [f'"{k}":null,'.encode() for k in ATROPOS_FIELDS if getattr(g, k) is UNSET]
        payload = b"{" + b"".join(absent) + raw[1:]
    else:
        payload = _encoder.encode({k: _get(g, k) for k in ATROPOS_FIELDS})
    overrides = _get(g, "group_overrides") or {}
    group_id = overrides.get("group_id")
    if group_id is None:
        group_id = "atropos-" + hashlib.sha256(payload).hexdigest()[:40]
    group_id = str(group_id)
    if not 1 <= len(group_id) <= GROUP_ID_MAX:
        raise ItemError(f"group_overrides.group_id must have 1..{GROUP_ID_MAX} characters")
    version = overrides.get("policy_version")
    if version is not None and (
        not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= VERSION_MAX
    ):
        raise ItemError(f"group_overrides.policy_version must be an integer in 0..{VERSION_MAX}")
    return PreparedGroup(group_id, version, env_id, n, sum(lengths), payload.decode())


def _check_finite(g: AtroposItem) -> None:
    if not all(map(math.isfinite, g.scores)):
        raise ItemError("scores must be finite")
    for name in ("inference_logprobs", "advantages", "ref_logprobs"):
        for i, row in enumerate(_get(g, name) or ()):
            if not all(map(math.isfinite, row)):
                raise ItemError(f"{name}[{i}] has a value that is not finite")

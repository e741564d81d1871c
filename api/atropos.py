"""Atropos wire compatibility: atroposlib's ``run-api`` routes on top of the durable store.

An unchanged Atropos environment (atroposlib ``BaseEnv``) or trainer can talk to this API.
The mapping (also in api/README.md):
- ``/register`` (trainer) stores its registration (batch size, step...) durably.
- ``/register-env`` registers env ``<desired_name>_<n>`` with its weight and group size and
  hands out an integer ``env_id``; like Atropos it answers "wait for trainer to start" until a
  trainer has asked for a batch (native ``/batches/lease`` counts too).
- ``/scored_data(_list)`` converts each group to the native contract: ``masks`` (labels,
  -100 = not trained) become a 0/1 ``mask``, ``inference_logprobs`` become ``logprobs``; the
  other Atropos fields ride along in ``extras.atropos``. ``group_id`` is
  ``group_overrides.group_id`` when given, else a hash of the group's content, so a retried
  post is stored once. ``policy_version`` is ``group_overrides.policy_version`` when given,
  else the live version. Atropos buffers groups whose size differs from the registered one;
  here every group is stored as is (batches never split groups, so no packing is needed).
- ``/batch`` leases ``batch_size`` sequences and answers them in Atropos's shape. Atropos has
  no ack: the previous ``/batch`` lease is acked by the next ``/batch`` call, or expires after
  ``atropos_lease_seconds`` and its groups go back (Atropos would have lost them).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from api.config import ApiConfig
from api.protocol import (
    AtroposEnvIdentifier,
    AtroposRegisterEnv,
    AtroposRegistration,
    AtroposScoredData,
    ScoredGroup,
    Status,
)
from api.store import Store, UnknownBatch

router = APIRouter(tags=["atropos"])
DEFAULT_ENV = "atropos"
MIN_ENV_WEIGHT = 0.01  # Atropos's floor: a weight-0 env still gets a trickle
_EXTRA_FIELDS = (
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "overrides",
    "group_overrides",
    "images",
)


def _store(request: Request) -> Store:
    return request.app.state.store


def _config(request: Request) -> ApiConfig:
    return request.app.state.config


@router.get("/")
def root() -> dict[str, str]:
    return {"message": "Shop-R1 batching API (AtroposLib API compatible)"}


@router.post("/register")
def register(body: AtroposRegistration, request: Request) -> dict[str, int]:
    """The Atropos trainer announces its batch size and schedule."""
    store = _store(request)
    store.set_meta("atropos", body.model_dump())
    if store.get_meta("atropos_step") is None:
        store.set_meta("atropos_step", body.starting_step)
    return {"uuid": uuid.uuid4().int}


@router.post("/register-env")
def register_env(body: AtroposRegisterEnv, request: Request) -> dict[str, Any]:
    store = _store(request)
    if not store.get_meta("started", False):
        return {"status": "wait for trainer to start"}
    reg = store.get_meta("atropos") or {}
    base = re.sub(r"[^A-Za-z0-9_.:\-]", "_", body.desired_name)
    env_id, same_name = store.next_atropos_id(base)
    name = f"{base}_{same_name}"
    store.register_env(
        name,
        max(MIN_ENV_WEIGHT, body.weight),
        body.group_size,
        atropos_id=env_id,
        max_token_length=body.max_token_length,
    )
    return {
        "status": "success",
        "env_id": env_id,
        "wandb_name": name,
        "checkpoint_dir": reg.get("checkpoint_dir", ""),
        "starting_step": store.get_meta("atropos_step", 0),
        "checkpoint_interval": reg.get("save_checkpoint_interval", -1),
        "num_steps": reg.get("num_steps", -1),
    }


@router.post("/disconnect-env")
def disconnect_env(body: AtroposEnvIdentifier, request: Request) -> dict[str, str]:
    store = _store(request)
    env = store.env_by_atropos_id(body.env_id)
    if env is None:
        return {"status": "failure", "error": f"unknown env_id {body.env_id}"}
    store.set_connected(env["name"], False)
    return {"status": "success"}


@router.get("/wandb_info")
def wandb_info(request: Request) -> dict[str, Any]:
    reg = _store(request).get_meta("atropos") or {}
    return {"group": reg.get("wandb_group"), "project": reg.get("wandb_project"), "zmq_port": None}


@router.get("/info")
def info(request: Request) -> dict[str, int]:
    reg = _store(request).get_meta("atropos") or {}
    return {"batch_size": reg.get("batch_size", -1), "max_token_len": reg.get("max_token_len", -1)}


@router.post("/scored_data")
def scored_data(body: AtroposScoredData, request: Request) -> dict[str, Any]:
    group = to_group(body, _store(request), _config(request))
    _store(request).ingest([group])
    return {"status": "received"}


@router.post("/scored_data_list")
def scored_data_list(body: list[AtroposScoredData], request: Request) -> dict[str, Any]:
    store = _store(request)
    groups = [to_group(item, store, _config(request), index=i) for i, item in enumerate(body)]
    store.ingest(groups)
    return {"status": "received", "groups_processed": len(groups)}


@router.get("/batch")
def batch(request: Request) -> dict[str, Any]:
    """Ack the previous Atropos batch, lease the next ``batch_size`` sequences."""
    store = _store(request)
    previous = store.get_meta("atropos_last_batch")
    if previous:
        try:
            store.ack(previous)
        except UnknownBatch:  # the store was reset since
            pass
        store.set_meta("atropos_last_batch", None)
    reg = store.get_meta("atropos") or {}
    batch_size = reg.get("batch_size", -1)
    if batch_size < 1:
        store.set_meta("started", True)
        return {"batch": None}
    leased = store.lease(None, batch_size, _config(request).atropos_lease_seconds)
    if leased is None:
        return {"batch": None}
    store.set_meta("atropos_last_batch", leased.batch_id)
    store.set_meta("atropos_step", store.get_meta("atropos_step", 0) + 1)
    return {"batch": [from_group(json.loads(p), store) for p in leased.payloads]}


@router.get("/latest_example")
def latest_example(request: Request) -> dict[str, Any]:
    store = _store(request)
    if store.latest_payload is None:
        empty = ("tokens", "masks", "scores", "advantages", "ref_logprobs", "generation_params",
                 "inference_logprobs", "messages", "images")  # fmt: skip
        return {k: [] for k in empty}
    return from_group(json.loads(store.latest_payload), store)


@router.get("/status-env")
def status_env(body: AtroposEnvIdentifier, request: Request) -> dict[str, Any]:
    """Atropos's per-env view (a GET with a JSON body, as atroposlib sends it)."""
    store = _store(request)
    env = store.env_by_atropos_id(body.env_id)
    if env is None:
        raise HTTPException(404, f"unknown env_id {body.env_id}")
    status = Status.model_validate(store.status())
    mine = next(e for e in status.envs if e.name == env["name"])
    total_weight = sum(e.weight for e in status.envs if e.connected) or 1.0
    queued_seqs = sum(e.queued_sequences for e in status.envs)
    group_size = max(1, env["group_size"])
    return {
        "current_step": store.get_meta("atropos_step", 0),
        "queue_size": queued_seqs // group_size,
        "unallocated_fraction": 1.0,
        "self_queue_size": mine.queued_sequences // group_size,
        "max_group_size": max([e.group_size for e in status.envs] + [1]),
        "env_weight": max(MIN_ENV_WEIGHT, env["weight"] / total_weight),
    }


@router.get("/reset_data")
def reset_data(request: Request) -> PlainTextResponse:
    """Forget every group, env, lease and registration (Atropos semantics)."""
    _store(request).reset()
    return PlainTextResponse("Reset successful")


# -- conversion ---------------------------------------------------------------------------


def to_group(item: AtroposScoredData, store: Store, cfg: ApiConfig, index: int = 0) -> ScoredGroup:
    """An Atropos group -> the native contract (HTTP 422 naming the problem if impossible)."""
    n = len(item.tokens)
    if len(item.masks) != n or len(item.scores) != n:
        raise HTTPException(
            422,
            f"item {index}: tokens, masks and scores must list the same number of "
            f"completions (got {n}, {len(item.masks)}, {len(item.scores)})",
        )
    logprobs = item.inference_logprobs
    if logprobs is None:
        if cfg.atropos_missing_logprobs == "reject":
            raise HTTPException(
                422,
                f"item {index}: inference_logprobs are required (the trainer's importance "
                "ratio needs them); start the API with --atropos-missing-logprobs zeros to "
                "store 0.0 instead",
            )
        logprobs = [[0.0] * len(t) for t in item.tokens]
    overrides = item.group_overrides or {}
    env = store.env_by_atropos_id(item.env_id) if item.env_id is not None else None
    extras: dict[str, Any] = {
        k: getattr(item, k) for k in _EXTRA_FIELDS if getattr(item, k) is not None
    }
    masks01 = [[0 if m == -100 else 1 for m in mask] for mask in item.masks]
    if any(
        _labels(t, m01) != m for t, m01, m in zip(item.tokens, masks01, item.masks, strict=False)
    ):
        extras["masks"] = item.masks  # not the usual labels form: keep it verbatim
    if item.inference_logprobs is None:
        extras["inference_logprobs_missing"] = True
    if item.env_id is not None:
        extras["env_id"] = item.env_id
    raw = {
        "group_id": str(overrides.get("group_id") or _content_id(item)),
        "env": env["name"] if env else DEFAULT_ENV,
        "policy_version": int(overrides.get("policy_version", store.policy_version)),
        "sequences": [
            {"tokens": t, "mask": m, "logprobs": lp, "score": s}
            for t, m, lp, s in zip(item.tokens, masks01, logprobs, item.scores, strict=False)
        ],
        "extras": {"atropos": extras},
    }
    try:
        return ScoredGroup.model_validate(raw)
    except ValidationError as e:
        raise HTTPException(422, f"item {index}: {e}") from None


def from_group(group: dict[str, Any], store: Store) -> dict[str, Any]:
    """A stored group -> the Atropos ``ScoredData`` shape."""
    extras = group.get("extras", {}).get("atropos", {})
    seqs = group["sequences"]
    out: dict[str, Any] = {k: extras.get(k) for k in _EXTRA_FIELDS}
    out["tokens"] = [s["tokens"] for s in seqs]
    out["masks"] = extras.get("masks") or [_labels(s["tokens"], s["mask"]) for s in seqs]
    out["scores"] = [s["score"] for s in seqs]
    missing = extras.get("inference_logprobs_missing", False)
    out["inference_logprobs"] = None if missing else [s["logprobs"] for s in seqs]
    out["env_id"] = extras.get("env_id")
    return out


def _labels(tokens: list[int], mask: list[int]) -> list[int]:
    return [t if m else -100 for t, m in zip(tokens, mask, strict=False)]


def _content_id(item: AtroposScoredData) -> str:
    """Idempotency key for a group posted without one: same content, same id."""
    blob = json.dumps(
        [item.env_id, item.tokens, item.masks, item.scores, item.inference_logprobs],
        separators=(",", ":"),
    )
    return "atropos-" + hashlib.sha256(blob.encode()).hexdigest()

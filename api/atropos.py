"""Atropos wire compatibility: atroposlib 0.4.0's ``run-api`` routes on the durable store.

An unchanged Atropos environment (atroposlib ``BaseEnv``) or trainer (its example trainer's
``register_trainer`` / ``get_batch`` / ``get_data``) talks to this API as to Atropos's own
server; the route-by-route comparison is in docs/INTERFACES.md. Storage and formation are in
``api.atropos_book`` (registration, packing, delivery, ``/status-env``) and
``api.atropos_wire`` (parsing, checks, conversion). In short:
- ``/scored_data(_list)``: every group is checked on its own; a bad one is rejected alone
  (its index and reason in the reply, and the API's log) and the others are stored. Groups
  are stored as posted (all Atropos fields) and served back verbatim. ``group_id`` is
  ``group_overrides.group_id``, else a hash of the content, so a retried post is stored once.
- ``/batch``: Atropos's own packing (exact ``batch_size``), served as leases with
  redelivery (see ``api.atropos_book``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from api import atropos_wire
from api.atropos_book import AtroposBook
from api.atropos_convert import from_native
from api.config import ApiConfig
from api.protocol import (
    AtroposEnvIdentifier,
    AtroposRegisterEnv,
    AtroposRegistration,
    AtroposScoredData,
)
from api.store import IngestResult, Row, Store

router = APIRouter(tags=["atropos"])
log = logging.getLogger("api.atropos")


def _store(request: Request) -> Store:
    return request.app.state.store


def _book(request: Request) -> AtroposBook:
    return request.app.state.atropos


def _config(request: Request) -> ApiConfig:
    return request.app.state.config


def _body_doc(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI request body for a route that parses its body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_ITEM_SCHEMA = AtroposScoredData.model_json_schema(ref_template="#/components/schemas/{model}")
_ITEM_SCHEMA.pop("$defs", None)


@router.get("/")
def root() -> dict[str, str]:
    return {"message": "Shop-R1 batching API (AtroposLib API compatible)"}


@router.post("/register")
def register(body: AtroposRegistration, request: Request) -> dict[str, int]:
    """The Atropos trainer announces its batch size and schedule (the first registration
    counts, as in Atropos); batches served and not yet acked are served again."""
    return {"uuid": _book(request).register_trainer(body.model_dump())}


@router.post("/register-env")
def register_env(body: AtroposRegisterEnv, request: Request) -> dict[str, Any]:
    return _book(request).register_env(
        body.desired_name,
        body.weight,
        body.group_size,
        body.max_token_length,
        body.min_batch_allocation,
    )


@router.post("/disconnect-env")
def disconnect_env(body: AtroposEnvIdentifier, request: Request) -> dict[str, str]:
    if not _book(request).disconnect(body.env_id):
        return {"status": "failure", "error": f"unknown env_id {body.env_id}"}
    return {"status": "success"}


@router.get("/wandb_info")
def wandb_info(request: Request) -> dict[str, Any]:
    reg = _book(request).registration() or {}
    return {"group": reg.get("wandb_group"), "project": reg.get("wandb_project")}


@router.get("/info")
def info(request: Request) -> dict[str, int]:
    """The Atropos trainer's batch size and length limit; with no Atropos trainer registered,
    the batch size (in sequences) a native trainer leases, so an unchanged atroposlib env that
    leaves ``batch_size`` at -1 sizes its queue by the trainer actually training."""
    reg = _book(request).registration()
    if reg is None:
        return {"batch_size": _store(request).native_batch_size(), "max_token_len": -1}
    return {"batch_size": reg.get("batch_size", -1), "max_token_len": reg.get("max_token_len", -1)}


@router.post("/scored_data", openapi_extra=_body_doc(_ITEM_SCHEMA))
async def scored_data(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return await run_in_threadpool(_ingest_one, request, raw)


@router.post("/scored_data_list", openapi_extra=_body_doc({"type": "array", "items": _ITEM_SCHEMA}))
async def scored_data_list(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return await run_in_threadpool(_ingest_list, request, raw)


def _ingest_one(request: Request, raw: bytes) -> dict[str, Any]:
    try:
        item = atropos_wire.decode_one(raw)
        prepared = atropos_wire.prepare(item, _config(request).atropos_missing_logprobs)
    except atropos_wire.ItemError as e:
        log.warning("rejected a group: %s", e)
        raise HTTPException(422, str(e)) from None
    result = _store_rows(request, [prepared])
    if result.buffered:
        return {"status": "buffered", "buffer_size": result.last_buffer_size}
    return {"status": "received"}


def _ingest_list(request: Request, raw: bytes) -> dict[str, Any]:
    try:
        items = atropos_wire.split_body(raw)
    except atropos_wire.ItemError as e:
        raise HTTPException(422, str(e)) from None
    policy = _config(request).atropos_missing_logprobs
    prepared, rejected = [], []
    for i, item in enumerate(items):
        try:
            prepared.append(atropos_wire.prepare(item, policy))
        except atropos_wire.ItemError as e:
            rejected.append({"index": i, "reason": str(e)})
    if rejected:
        log.warning("rejected %d of %d groups: %s", len(rejected), len(items), rejected[:3])
        if not prepared:
            raise HTTPException(422, {"rejected": rejected})
    result = _store_rows(request, prepared)
    reply: dict[str, Any] = {"status": "received", "groups_processed": len(items)}
    if result.buffered:
        reply["buffered"] = result.buffered
        reply["last_buffer_size"] = result.last_buffer_size
    if rejected:
        reply["rejected"] = rejected
    return reply


def _store_rows(request: Request, prepared: list[atropos_wire.PreparedGroup]) -> IngestResult:
    rows = [
        Row(
            p.group_id, None, p.policy_version, p.n_seqs, p.n_tokens, p.payload, "atropos", p.env_id
        )
        for p in prepared
    ]
    return _store(request).ingest_rows(rows)


@router.get("/batch")
async def batch(request: Request) -> Response:
    """Ack what this trainer was served before; serve the next ``batch_size`` sequences
    (with a ``batch_id``, which ``POST /batches/{batch_id}/ack`` also accepts)."""
    book = _book(request)
    await request.body()  # consumed, so that is_disconnected() below sees the client's state
    cfg = _config(request)
    ack_previous = cfg.atropos_ack == "next_batch"
    got = await run_in_threadpool(book.next_batch, cfg.atropos_lease_seconds, ack_previous)
    if got is None or isinstance(got, dict):
        return JSONResponse(got or {"batch": None})
    batch_id, payloads = got
    if await request.is_disconnected():  # the trainer gave up waiting: keep it for later
        await run_in_threadpool(book.release, batch_id)
        return Response(status_code=499)
    content = '{"batch":[' + ",".join(payloads) + '],"batch_id":' + json.dumps(batch_id) + "}"
    return Response(content=content, media_type="application/json")


@router.get("/latest_example")
def latest_example(request: Request) -> Response:
    latest = _store(request).latest_payload
    if latest is None:
        empty = (
            "tokens",
            "masks",
            "scores",
            "advantages",
            "ref_logprobs",
            "generation_params",
            "inference_logprobs",
            "messages",
            "images",
        )
        return JSONResponse({k: [] for k in empty})
    fmt, payload = latest
    body = payload if fmt == "atropos" else from_native(payload)
    return Response(content=body, media_type="application/json")


@router.get("/status-env")
def status_env(body: AtroposEnvIdentifier, request: Request) -> dict[str, Any]:
    """Atropos's per-env view (a GET with a JSON body, as atroposlib sends it)."""
    status = _book(request).status_env(body.env_id)
    if status is None:
        raise HTTPException(404, f"unknown env_id {body.env_id}")
    return status


@router.get("/reset_data")
def reset_data(request: Request) -> PlainTextResponse:
    """Forget every group, env, lease and registration (Atropos semantics)."""
    _store(request).reset()
    return PlainTextResponse("Reset successful")

"""The native routes (docs/INTERFACES.md): ingest, envs, backpressure, leases, versions, status.

Routes are plain ``def``: FastAPI runs them in its thread pool, where the blocking SQLite
calls belong. A leased batch is answered with the groups' stored JSON spliced in as is,
so serving costs no re-validation or re-serialisation of the payload.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.protocol import (
    ENV_NAME_PATTERN,
    AckResponse,
    Backpressure,
    Health,
    Lease,
    LeaseRequest,
    PolicyVersionRequest,
    PolicyVersionResponse,
    PushGroupsRequest,
    PushGroupsResponse,
    RegisterEnvRequest,
    RegisterEnvResponse,
    RejectRequest,
    RejectResponse,
    SkipResponse,
    Status,
)
from api.store import Store, UnknownBatch

router = APIRouter()


def store_of(request: Request) -> Store:
    return request.app.state.store


@router.get("/health", response_model=Health, tags=["service"])
def health() -> Health:
    return Health()


# The body is parsed by hand (below), so its schema is declared here; the nested models are
# in the spec's components already (the Lease response uses them).
_push_schema = PushGroupsRequest.model_json_schema(ref_template="#/components/schemas/{model}")
_push_schema.pop("$defs", None)
_PUSH_BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": _push_schema}}}
}


@router.post(
    "/groups", response_model=PushGroupsResponse, tags=["ingest"], openapi_extra=_PUSH_BODY
)
async def push_groups(request: Request) -> PushGroupsResponse:
    """Store scored groups (all or none). A repeated `group_id` is counted as a duplicate."""
    raw = await request.body()
    # pydantic's own JSON parser validates ~2.5x faster than json.loads + validation, and
    # ingest is the hot path: parse here, off the event loop.
    return await run_in_threadpool(_ingest, store_of(request), raw)


def _ingest(store: Store, raw: bytes) -> PushGroupsResponse:
    try:
        body = PushGroupsRequest.model_validate_json(raw)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise RequestValidationError(errors) from None
    result = store.ingest(body.groups)
    return PushGroupsResponse(
        accepted=result.accepted, duplicates=result.duplicates, stale=result.stale
    )


@router.post("/envs/register", response_model=RegisterEnvResponse, tags=["envs"])
def register_env(body: RegisterEnvRequest, request: Request) -> RegisterEnvResponse:
    """Register an environment (or update its weight and group size)."""
    store = store_of(request)
    store.register_env(body.name, body.weight, body.group_size)
    return RegisterEnvResponse(**body.model_dump(), policy_version=store.policy_version)


@router.get("/backpressure", response_model=Backpressure, tags=["envs"])
def backpressure(request: Request, env: str = Query(pattern=ENV_NAME_PATTERN)) -> Backpressure:
    """How many groups `env` may push now so the queue stays within the staleness bound."""
    store = store_of(request)
    wanted, version = store.wanted(env)
    return Backpressure(
        wanted=wanted, policy_version=version, skipped_batches=store.skipped_batches
    )


@router.post(
    "/batches/lease",
    response_model=Lease,
    responses={204: {"description": "Not enough data queued to fill the budget yet."}},
    tags=["batches"],
)
def lease(body: LeaseRequest, request: Request) -> Response:
    """Lease the next batch: groups mixed by env weight, never split, within the budget."""
    batch = store_of(request).lease(
        body.max_tokens, body.max_sequences, body.lease_seconds, body.allow_partial
    )
    if batch is None:
        return Response(status_code=204)
    head = json.dumps(
        {
            "batch_id": batch.batch_id,
            "lease_deadline": batch.deadline,
            "policy_version": batch.policy_version,
        }
    )
    content = head[:-1] + ',"groups":[' + ",".join(batch.payloads) + "]}"
    return Response(content=content, media_type="application/json")


@router.post("/batches/{batch_id}/ack", response_model=AckResponse, tags=["batches"])
def ack(batch_id: str, request: Request) -> AckResponse:
    """Mark a leased batch consumed. Idempotent; see `AckResponse.status` for late acks."""
    try:
        status, n = store_of(request).ack(batch_id)
    except UnknownBatch:
        raise HTTPException(404, f"unknown batch_id {batch_id!r}") from None
    return AckResponse(batch_id=batch_id, status=status, groups_acked=n)


@router.post("/batches/{batch_id}/skip", response_model=SkipResponse, tags=["batches"])
def skip(batch_id: str, request: Request) -> SkipResponse:
    """Mark a leased batch consumed but not trained (the trainer skipped its update because
    of a non-finite gradient): its groups are never served again nor counted as acked."""
    try:
        status, n = store_of(request).skip(batch_id)
    except UnknownBatch:
        raise HTTPException(404, f"unknown batch_id {batch_id!r}") from None
    return SkipResponse(batch_id=batch_id, status=status, groups_skipped=n)


@router.post("/batches/{batch_id}/reject", response_model=RejectResponse, tags=["batches"])
def reject(batch_id: str, body: RejectRequest, request: Request) -> RejectResponse:
    """The trainer refuses some groups of a leased batch (a field it cannot honour, named in
    the reason): they become `rejected` (kept, never served again); ack or skip the rest."""
    reasons = {r.group_id: r.reason for r in body.groups}
    try:
        n, missing = store_of(request).reject(batch_id, reasons)
    except UnknownBatch:
        raise HTTPException(404, f"unknown batch_id {batch_id!r}") from None
    return RejectResponse(batch_id=batch_id, groups_rejected=n, not_in_batch=missing)


@router.post("/policy_version", response_model=PolicyVersionResponse, tags=["versions"])
def set_policy_version(body: PolicyVersionRequest, request: Request) -> PolicyVersionResponse:
    """Report the weight version now live; queued groups beyond `max_staleness` are dropped."""
    dropped = store_of(request).set_policy_version(body.version)
    return PolicyVersionResponse(version=body.version, dropped=dropped)


@router.get("/status", response_model=Status, tags=["service"])
def status(request: Request) -> Status:
    """Queue depth per env, versions, leases, drops, rates (a superset of Atropos's /status)."""
    return Status.model_validate(store_of(request).status())

"""Wire schemas of the batching API (pydantic). The data contract is docs/INTERFACES.md.

Everything that crosses the wire is JSON validated by these models; nothing is pickled.
Validation is strict where a bad value would poison training (lengths that disagree, non-finite
scores, empty groups) and lenient where it only costs a label (free-form ``metrics``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api.protocol_atropos import AtroposFields

GROUP_ID_MAX = 200
"""Longest accepted ``group_id`` (an idempotency key, usually a UUID)."""
# SQLite stores 64-bit signed integers and JSON numbers are exact to 2**53: larger versions or
# budgets are client bugs, answered with 422 rather than an overflow (500) in the store.
VERSION_MAX = 2**53
"""Largest accepted policy/weight version."""
BUDGET_MAX = 2**40
"""Largest accepted token or sequence budget of a lease."""
ENV_NAME_PATTERN = r"^[A-Za-z0-9_.:\-]{1,100}$"
"""Environment names: short, printable, safe in logs and URLs."""


class ScoredSequence(BaseModel):
    """One completion of a group, aligned token by token."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(
        min_length=1,
        description="The episode's token ids exactly as sampled: prompt + completion, or for a "
        "multi-turn episode prompt, then each turn's sampled tokens and the environment's reply.",
    )
    mask: list[Literal[0, 1]] = Field(
        description="1 = a token the model sampled (trained on); 0 = prompt, environment or "
        "tool reply. A multi-turn episode interleaves runs of 1 and 0."
    )
    logprobs: list[float] = Field(description="Inference logprobs aligned to `tokens`.")
    score: float = Field(description="The reward of this completion (finite).")
    advantages: list[float] | None = Field(
        None,
        exclude_if=lambda v: v is None,  # stored and served as before when not given
        description="The environment's own per-token advantages, aligned to `tokens` (e.g. "
        "per-turn credit); they replace the group-normalised `score` on this sequence's "
        "tokens. Omitted: the episode's score, normalised in its group, on every sampled token.",
    )
    spans: dict[str, list[Literal[0, 1]]] = Field(
        default_factory=dict,
        description="Named 0/1 token masks aligned to `tokens`, e.g. `rationale`.",
    )

    @field_validator("score")
    @classmethod
    def _finite_score(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("score must be finite")
        return v

    @field_validator("logprobs", "advantages")
    @classmethod
    def _finite_values(cls, v: list[float] | None, info: ValidationInfo) -> list[float] | None:
        for i, x in enumerate(v or []):
            if not math.isfinite(x):
                raise ValueError(f"{info.field_name}[{i}] is not finite")
        return v

    @model_validator(mode="after")
    def _aligned(self) -> ScoredSequence:
        n = len(self.tokens)
        if len(self.mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"tokens, mask and logprobs must have equal lengths "
                f"(got {n}, {len(self.mask)}, {len(self.logprobs)})"
            )
        for name, span in self.spans.items():
            if len(span) != n:
                raise ValueError(f"spans.{name} has length {len(span)}, tokens has {n}")
        if self.advantages is not None and len(self.advantages) != n:
            raise ValueError(f"advantages has length {len(self.advantages)}, tokens has {n}")
        return self


class ScoredGroup(BaseModel):
    """All completions of one prompt, scored. ``group_id`` is the idempotency key."""

    model_config = ConfigDict(extra="forbid")

    group_id: str = Field(min_length=1, max_length=GROUP_ID_MAX, description="Unique id.")
    env: str = Field(pattern=ENV_NAME_PATTERN, description="Name of the producing environment.")
    policy_version: int = Field(
        ge=0, le=VERSION_MAX, description="Weight version that sampled the group."
    )
    sequences: list[ScoredSequence] = Field(min_length=1, description="The completions.")
    metrics: dict[str, float | int | bool | str | None] = Field(
        default_factory=dict, description="Free-form per-group metrics (e.g. reward parts)."
    )
    extras: dict[str, Any] = Field(
        default_factory=dict,
        description="Opaque fields passed through to the trainer unchanged.",
    )
    atropos: AtroposFields | None = Field(
        None,
        exclude_if=lambda v: v is None,  # a native group is stored and served as before
        description="What an Atropos group sent beyond tokens, masks, scores and logprobs "
        "(`advantages`, `ref_logprobs`, `overrides`, ...; api/protocol_atropos.py). Groups "
        'stored before it existed carry it as `extras["atropos"]`, read into this field.',
    )

    @model_validator(mode="after")
    def _lift_atropos(self) -> ScoredGroup:
        """The older form, ``extras["atropos"]`` (queues and dumps written before the typed
        field), moved into ``atropos``."""
        if "atropos" not in self.extras:
            return self
        if self.atropos is not None:
            raise ValueError('give the Atropos fields once: atropos or extras["atropos"]')
        old = self.extras.pop("atropos")
        try:
            self.atropos = AtroposFields.model_validate({} if old is None else old)
        except ValidationError as e:
            errors = "; ".join(
                ".".join(map(str, ["extras.atropos", *err["loc"]])) + ": " + err["msg"]
                for err in e.errors()
            )
            raise ValueError(errors) from None
        return self

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)


# --- ingest -------------------------------------------------------------------------------


class PushGroupsRequest(BaseModel):
    """Body of ``POST /groups``. All-or-nothing: one invalid group rejects the request."""

    groups: list[ScoredGroup] = Field(min_length=1)


class PushGroupsResponse(BaseModel):
    accepted: int = Field(description="Groups newly stored by this request.")
    duplicates: int = Field(description="Groups whose group_id was already stored (kept once).")
    stale: int = Field(0, description="Accepted groups already beyond max_staleness (dropped).")


# --- environments and backpressure --------------------------------------------------------


class RegisterEnvRequest(BaseModel):
    """Body of ``POST /envs/register``; registering again updates weight and group size."""

    name: str = Field(pattern=ENV_NAME_PATTERN)
    weight: float = Field(1.0, gt=0, le=1e6, description="Share of batches (relative).")
    group_size: int = Field(1, ge=1, le=65536, description="Sequences per group.")


class RegisterEnvResponse(BaseModel):
    name: str
    weight: float
    group_size: int
    policy_version: int


class Backpressure(BaseModel):
    """Reply of ``GET /backpressure?env=NAME``."""

    wanted: int = Field(description="Groups this env may push now without overfilling.")
    policy_version: int = Field(description="Weight version the trainer reported last.")
    skipped_batches: int = Field(
        0,
        description="Batches a trainer skipped (a non-finite gradient: trained on, the version "
        "unchanged). An env that samples in lockstep with the versions samples again for one.",
    )


# --- batches ------------------------------------------------------------------------------


class LeaseRequest(BaseModel):
    """Body of ``POST /batches/lease``. At least one of the two budgets must be given."""

    max_tokens: int | None = Field(
        None, ge=1, le=BUDGET_MAX, description="Budget: sum of sequence lengths."
    )
    max_sequences: int | None = Field(
        None, ge=1, le=BUDGET_MAX, description="Budget: number of sequences."
    )
    lease_seconds: float = Field(300.0, gt=0, le=7 * 86400, description="Lease duration.")
    allow_partial: bool = Field(
        False, description="Serve what is queued even if it does not fill the budget."
    )

    @model_validator(mode="after")
    def _some_budget(self) -> LeaseRequest:
        if self.max_tokens is None and self.max_sequences is None:
            raise ValueError("give max_tokens and/or max_sequences")
        return self


class Lease(BaseModel):
    """A leased batch (``200``); ``204`` means not enough data yet."""

    batch_id: str
    groups: list[ScoredGroup]
    lease_deadline: float = Field(description="Unix time after which the groups go back.")
    policy_version: int = Field(description="Weight version when the batch was formed.")


class AckResponse(BaseModel):
    batch_id: str
    status: Literal["acked", "already_acked", "acked_late", "already_skipped"] = Field(
        description="`acked_late`: the lease had expired; groups not re-leased were acked. "
        "`already_skipped`: the trainer skipped the batch (not trained); it stays so."
    )
    groups_acked: int


class SkipResponse(BaseModel):
    batch_id: str
    status: Literal["skipped", "skipped_late", "already_skipped", "already_acked"] = Field(
        description="`skipped_late`: the lease had expired; groups not re-leased were skipped. "
        "`already_acked`: the batch was acked as trained before; it stays so."
    )
    groups_skipped: int


class Rejection(BaseModel):
    group_id: str = Field(min_length=1, max_length=GROUP_ID_MAX)
    reason: str = Field(min_length=1, max_length=2000, description="Why the trainer refuses it.")


class RejectRequest(BaseModel):
    groups: list[Rejection] = Field(min_length=1, max_length=100_000)


class RejectResponse(BaseModel):
    batch_id: str
    groups_rejected: int = Field(description="Groups of this batch now `rejected` (or already).")
    not_in_batch: list[str] = Field(
        description="Group ids that are not this batch's (unknown, or leased again since)."
    )


class PolicyVersionRequest(BaseModel):
    version: int = Field(
        ge=0, le=VERSION_MAX, description="Weight version now live on the inference servers."
    )


class PolicyVersionResponse(BaseModel):
    version: int
    dropped: int = Field(description="Queued groups dropped as too stale by this update.")


# --- status -------------------------------------------------------------------------------


class EnvStatus(BaseModel):
    name: str
    weight: float
    group_size: int
    connected: bool
    queued_groups: int
    queued_sequences: int
    leased_groups: int
    acked_groups: int
    dropped_groups: int = Field(description="Dropped for staleness (never served).")
    skipped_groups: int = Field(0, description="Served, but the trainer skipped the update.")
    rejected_groups: int = Field(
        0, description="Served, but refused by the trainer (a field it cannot honour)."
    )
    duplicate_groups: int
    min_queued_version: int | None
    max_queued_version: int | None
    wanted: int


class Status(BaseModel):
    current_step: int = Field(description="Batches served so far (Atropos field name).")
    queue_size: int = Field(description="Queued groups, all envs (Atropos field name).")
    policy_version: int
    max_staleness: int
    envs: list[EnvStatus]
    queued_groups: int
    active_leases: int
    expired_leases: int
    acked_batches: int
    skipped_batches: int = Field(0, description="Leased, not trained (non-finite gradient).")
    rejected_groups: int = Field(0, description="Refused by the trainer, all envs.")
    dropped_groups: int
    ingest_groups_per_s: float = Field(description="Over the last `rate_window_s` seconds.")
    serve_groups_per_s: float = Field(description="Over the last `rate_window_s` seconds.")
    rate_window_s: float
    storage_free_bytes: int | None = Field(
        None, description="Free bytes on the database's filesystem (null: in memory)."
    )
    storage_reserve_bytes: int = Field(
        0, description="Below this much free space pushes are refused (507; `min_free_mb`)."
    )
    storage_low: bool = Field(
        False, description="Pushes are being refused: below the reserve, or the disk was full."
    )
    storage_refusals: int = Field(
        0, description="Requests answered 507/503 (full disk, I/O error) since the API started."
    )


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    service: Literal["shop-r1-api"] = "shop-r1-api"
    """Says which service answers (api/service_check.py tells a client pointed elsewhere)."""


# --- Atropos wire compatibility (field names as atroposlib's run-api sends them) ----------


class AtroposRegistration(BaseModel):
    """Body of Atropos ``POST /register`` (the trainer announces itself)."""

    wandb_group: str = ""
    wandb_project: str = ""
    batch_size: int = Field(
        ge=1, le=BUDGET_MAX, description="Sequences per batch served by GET /batch."
    )
    max_token_len: int = -1
    checkpoint_dir: str = ""
    save_checkpoint_interval: int = -1
    starting_step: int = Field(0, ge=0, le=VERSION_MAX)
    num_steps: int = -1


class AtroposRegisterEnv(BaseModel):
    """Body of Atropos ``POST /register-env``."""

    max_token_length: int = Field(-1, ge=-(2**31), le=2**31)
    desired_name: str = Field(min_length=1, max_length=80)
    weight: float = Field(
        1.0,
        allow_inf_nan=False,
        description="Atropos inference weight; <= 0 (e.g. -1: 'ignore') gets the floor 0.01.",
    )
    group_size: int = Field(1, ge=1, le=65536)
    min_batch_allocation: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Least share of each `GET /batch` batch for this env (Atropos packing).",
    )


class AtroposEnvIdentifier(BaseModel):
    env_id: int = Field(ge=0, le=VERSION_MAX)


class AtroposScoredData(BaseModel):
    """One group as Atropos envs post it: parallel lists, one entry per completion (the
    documented schema of ``/scored_data``; the route decodes with ``api.atropos_wire``).

    `masks` are Atropos labels: -100 on tokens not to train, the token id elsewhere."""

    tokens: list[list[int]] = Field(min_length=1)
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None

"""A verifiers branch -> one ``ScoredSequence`` of our data contract (docs/VERIFIERS.md).

A verifiers ``Trace`` is a message graph; each ``Branch`` (a root-to-leaf path) carries one
flat token sequence: ``token_ids`` (every node's tokens, concatenated), ``sampled_mask``
(True on the tokens the model sampled), ``logprobs`` (the sampled tokens' logprobs, 0.0
elsewhere) and, if the environment assigned any, per-token ``advantages``. They become

    tokens    = branch.token_ids, exactly
    mask      = branch.sampled_mask as 0/1 (1 = model-sampled; 0 = prompt, user/env/tool)
    logprobs  = branch.logprobs (0.0 under mask 0)
    score     = the trace's reward (the env's weighted rewards, summed)
    advantages= branch.advantages when the env set them (per token), else omitted

and nothing is ever re-rendered. Each run of mask 1 must be a completion the inference
server returned, for a prompt equal to the branch's tokens before the run (the recording
proxy's ``Turn``s, proxy.py): that proves the tokens are the ones sampled and gives the
weight version of each turn. Anything else is refused (:class:`Refused`, with a reason
code counted in the service's metrics), never pushed with tokens we cannot vouch for.

Pure Python on duck-typed inputs (no verifiers import): the unit tests run in the main venv.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REFUSALS = (
    "no_tokens",  # the branch carries no token ids: the client was not a token (train) client
    "lengths",  # tokens, mask and logprobs have different lengths
    "no_sampled",  # no token is marked as sampled
    "bad_logprob",  # a logprob is not finite, or a non-sampled token has a nonzero one
    "bad_token",  # a token id is not a non-negative int
    "not_sampled",  # a sampled run is not a completion the server returned for that prefix
    "no_reward",  # the trace has no finite reward
)


class Refused(ValueError):
    """A branch we will not turn into a training sample; ``code`` is one of ``REFUSALS``."""

    def __init__(self, code: str, message: str) -> None:
        assert code in REFUSALS, code
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Turn:
    """One ``/inference/v1/generate`` exchange as the inference server answered it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int | None
    """The ``x-weight-version`` header (None: the server did not send one)."""
    session: str | None = None
    """verifiers' ``X-Session-ID`` (the rollout's trace id)."""


@dataclass
class Converted:
    """A branch's sequence and the weight version of each of its sampled runs."""

    sequence: dict[str, Any]
    versions: list[int | None] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)
    """The ``[start, end)`` token ranges of the sampled runs (one per model turn)."""
    turns: list[Turn] = field(default_factory=list)
    """The recorded exchange each run matched."""


def sampled_runs(mask: Sequence[int | bool]) -> list[tuple[int, int]]:
    """Maximal ``[start, end)`` ranges where ``mask`` is true."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def index_turns(turns: Sequence[Turn]) -> dict[tuple[int, ...], list[Turn]]:
    """Recorded turns by their prompt ids (several samples may share a prompt)."""
    out: dict[tuple[int, ...], list[Turn]] = {}
    for t in turns:
        out.setdefault(t.prompt_ids, []).append(t)
    return out


def _match(tokens: list[int], run: tuple[int, int], by_prompt: Mapping) -> Turn | None:
    start, end = run
    sampled = tuple(tokens[start:end])
    for t in by_prompt.get(tuple(tokens[:start]), ()):
        if t.completion_ids == sampled:
            return t
    return None


def branch_to_sequence(
    token_ids: Sequence[int] | None,
    mask: Sequence[bool | int] | None,
    logprobs: Sequence[float] | None,
    score: float,
    advantages: Sequence[float] | None = None,
    turns: Mapping[tuple[int, ...], list[Turn]] | None = None,
) -> Converted:
    """The checked ``ScoredSequence`` dict of one branch (raises :class:`Refused`).

    ``turns``: the recorded exchanges by prompt (:func:`index_turns`); every sampled run
    must be one of them. ``None`` skips that check (and the versions stay unknown)."""
    if not token_ids:
        raise Refused("no_tokens", "the branch has no token ids (use a train client)")
    tokens = list(token_ids)
    n = len(tokens)
    lengths = {"tokens": n, "mask": len(mask or ()), "logprobs": len(logprobs or ())}
    if advantages is not None:
        lengths["advantages"] = len(advantages)
    if len(set(lengths.values())) != 1:
        raise Refused("lengths", f"lengths differ: {lengths}")
    assert mask is not None and logprobs is not None
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise Refused("bad_token", "token ids must be non-negative ints")
    bits = [1 if m else 0 for m in mask]
    runs = sampled_runs(bits)
    if not runs:
        raise Refused("no_sampled", "no token of the branch was sampled by the model")
    lps = [float(x) for x in logprobs]
    for i, (b, x) in enumerate(zip(bits, lps, strict=True)):
        if not math.isfinite(x) or (b == 0 and x != 0.0):
            raise Refused("bad_logprob", f"logprobs[{i}] = {x!r} under mask {b}")
    if not math.isfinite(score):
        raise Refused("no_reward", f"score {score!r} is not finite")
    versions: list[int | None] = []
    matched: list[Turn] = []
    if turns is not None:
        for run in runs:
            turn = _match(tokens, run, turns)
            if turn is None:
                raise Refused(
                    "not_sampled",
                    f"tokens [{run[0]}, {run[1]}) are marked sampled but are not a completion "
                    "the inference server returned for the tokens before them",
                )
            versions.append(turn.weight_version)
            matched.append(turn)
    seq: dict[str, Any] = {"tokens": tokens, "mask": bits, "logprobs": lps, "score": float(score)}
    if advantages is not None:
        adv = [float(a) for a in advantages]
        if not all(math.isfinite(a) for a in adv):
            raise Refused("bad_logprob", "advantages must be finite")
        seq["advantages"] = adv
    return Converted(seq, versions, runs, matched)


def group_version(versions: Sequence[int | None], fallback: int) -> int:
    """The group's ``policy_version``: the oldest weight version that sampled any of its
    turns (``fallback``, the API's version, when the server reported none)."""
    known = [v for v in versions if v is not None]
    return min(known) if known else fallback

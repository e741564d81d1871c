"""``POST /generate`` in the wire format of Atropos's own vLLM server
(``example_trainer/vllm_api_server.py`` in atroposlib 0.4.0), which atroposlib's
``VLLMServer`` (``server_type="vllm"``) posts to for ``tokens_and_logprobs_completion`` and
``get_logprobs`` -- so an unchanged atroposlib environment rolls out against this server.

Request: ``prompt`` (a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``) plus
vLLM ``SamplingParams`` fields (``n``, ``max_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``logprobs``, ``prompt_logprobs``, ...). Response: ``text`` and ``finish_reasons`` (one
per completion) and ``prompt``; with ``logprobs``: ``logprobs`` (per completion, per token
``[{token_id: logprob, ...}]``, the sampled token first), ``token_ids`` and
``prompt_token_ids``; with ``prompt_logprobs``: ``prompt_logprobs`` (per prompt position
``{token_id: logprob, ...}``, the prompt's own token first; ``null`` at position 0). Ours
adds ``weight_version`` (as in the ``x-weight-version`` header, which it also carries).

Same guards as ``/v1/completions``: no bridge token (an inference route), vLLM's
``--api-key`` / ``VLLM_API_KEY`` when set (vLLM guards only ``/v1``-style paths itself, so this
route checks it). An unknown field is a 400 naming it (Atropos's server answers a 500), and
so is every body vLLM's engine would fail on rather than refuse: a field of the wrong type
(checked against ``SamplingParams``' own annotations), an integer beyond 64 bits (the engine's
wire format), a lone surrogate in a string (the tokenizer cannot encode it), JSON nested deeper
than the parser goes.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

router = APIRouter()

SAMPLING_FIELDS = frozenset(
    {
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
    }
)
"""The ``SamplingParams`` fields a request may set (Atropos's server passes the body to
``SamplingParams(**body)``)."""


def api_keys(args: Any) -> list[bytes]:
    """SHA-256 of vLLM's API keys (``--api-key``, else ``VLLM_API_KEY``), as vLLM hashes them."""
    import vllm.envs as envs

    keys = [k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k]
    return [hashlib.sha256(k.encode()).digest() for k in keys]


def _authorised(request: Request, keys: list[bytes]) -> bool:
    if not keys:
        return True
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = hashlib.sha256(value.encode()).digest()
    return any(secrets.compare_digest(given, k) for k in keys)


def parse_prompt(prompt: Any) -> dict[str, Any]:
    """The engine prompt of a request's ``prompt`` (400 on anything else)."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        if ids is not None and set(prompt) == {"prompt_token_ids"}:
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise HTTPException(400, "prompt.prompt_token_ids must be a non-empty int list")
            return {"prompt_token_ids": list(ids)}
        if isinstance(prompt.get("prompt"), str) and set(prompt) == {"prompt"}:
            return {"prompt": prompt["prompt"]}
    raise HTTPException(
        400, 'prompt must be a string, {"prompt_token_ids": [int, ...]} or {"prompt": "..."}'
    )


def sampling_params(body: dict[str, Any]) -> Any:
    """``SamplingParams`` from the request's other fields (400 naming an unknown one, a value
    of the wrong type or one the engine cannot carry)."""
    import msgspec
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    unknown = sorted(set(body) - SAMPLING_FIELDS)
    if unknown:
        raise HTTPException(
            400, f"unknown field(s) {unknown}: /generate takes prompt and SamplingParams fields"
        )
    try:
        # The types vLLM declares (a JSON object's keys are strings: logit_bias' become ints).
        typed = msgspec.convert(body, SamplingParams, strict=False)
        fields = {name: getattr(typed, name) for name in body}
        check_plain(fields)
        return SamplingParams(**fields, output_kind=RequestOutputKind.FINAL_ONLY)
    except (TypeError, ValueError) as e:
        raise HTTPException(400, f"invalid sampling parameters: {e}") from None


INT64 = range(-(2**63), 2**63)
"""Integers the engine's wire format (msgpack) carries; a larger one fails inside vLLM."""


def check_plain(value: Any) -> None:
    """``ValueError`` unless every integer of ``value`` (keys included) fits in 64 bits and
    every string is valid Unicode (a lone surrogate, which JSON's ``\\ud800`` escape allows,
    makes the tokenizer raise). Iterative: ``value`` may be as deep as the JSON parser went."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool) and v not in INT64:
            raise ValueError(f"integer {v} does not fit in 64 bits")
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"string {v[:40]!r} is not valid Unicode text") from None


def _position(entry: Any, first: int) -> dict[int, float]:
    """One position's ``{token_id: logprob}``, ``first`` (the sampled/prompt token) first."""
    out = {first: float(entry[first].logprob)} if first in entry else {}
    out.update({int(t): float(lp.logprob) for t, lp in entry.items() if t != first})
    return out


def response_body(final: Any, params: Any, tokenizer: Any, version: str) -> dict[str, Any]:
    """Atropos's ``/generate`` reply for one finished ``RequestOutput``."""
    prompt_ids = list(final.prompt_token_ids or [])
    prompt = final.prompt
    if prompt is None and tokenizer is not None:
        prompt = tokenizer.decode(prompt_ids)
    outputs = list(final.outputs)
    body: dict[str, Any] = {
        "text": [o.text for o in outputs],
        "prompt": prompt,
        "finish_reasons": [o.finish_reason for o in outputs],
    }
    if params.logprobs is not None:
        body["logprobs"] = [
            [[_position(e, t)] for e, t in zip(o.logprobs or [], o.token_ids, strict=False)]
            for o in outputs
        ]
        body["prompt_token_ids"] = prompt_ids
        body["token_ids"] = [list(o.token_ids) for o in outputs]
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = [
            None if e is None else _position(e, t)
            for e, t in zip(final.prompt_logprobs or [], prompt_ids, strict=False)
        ]
    body["weight_version"] = version
    return body


@router.post("/generate")
async def generate(request: Request) -> JSONResponse:
    """Atropos's ``/generate`` (module docstring): completions with per-token logprobs."""
    st = request.app.state.bridge
    version = getattr(request.state, "weight_version", st.version)  # what the header says
    if not _authorised(request, st.api_keys):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json parses
        raise HTTPException(400, "body is not JSON") from None
    if not isinstance(body, dict) or "prompt" not in body:
        raise HTTPException(400, 'body must be a JSON object with "prompt"')
    body = dict(body)
    prompt = parse_prompt(body.pop("prompt"))
    try:
        check_plain(prompt)
    except ValueError as e:
        raise HTTPException(400, f"invalid prompt: {e}") from None
    if body.pop("stream", False):
        raise HTTPException(
            400, "stream is not supported by this /generate (atroposlib never asks)"
        )
    params = sampling_params(body)
    engine = st.engine_client
    lora = None
    if st.settings.mode == "lora_only":  # the adapter of the newest synced version
        lora = request.app.state.openai_serving_models.lora_requests.get(st.served_model)
    from vllm.exceptions import VLLMClientError

    final = None
    try:
        async for out in engine.generate(
            prompt, params, f"atropos-generate-{uuid.uuid4().hex}", lora_request=lora
        ):
            final = out
    except (ValueError, VLLMClientError) as e:  # vLLM's input checks (ids, length, ...)
        raise HTTPException(400, str(e)) from None
    if final is None:
        raise HTTPException(500, "the engine returned no output")
    tokenizer = getattr(engine, "tokenizer", None)
    return JSONResponse(response_body(final, params, tokenizer, version))

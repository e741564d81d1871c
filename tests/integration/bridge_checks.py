"""The bridge tests' checks on the tiny model: a real optimizer step, transformers' greedy
reference, vLLM's greedy completion, and a request in flight during a sync
(tests/integration/vllm_patching/test_bridge_modes.py; test_bridge_modes_smol.py reuses some)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from bench.sync.probes import stream_body
from vllm_patching.protocol import VERSION_HEADER

PROMPT = "Click the search button to find running shoes"
N_TOKENS = 16


# ------------------------------------------------------------------------------- helpers
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


def optimizer_step(model: torch.nn.Module, ids: list[int], lr: float = 1e-2) -> None:
    """One real AdamW step on next-token loss: moves every trainable tensor, embeddings too."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    x = torch.tensor([ids])
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, ids: list[int], n: int = N_TOKENS
) -> tuple[list[int], list[float]]:
    seq, logprobs = list(ids), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        tok = int(lp.argmax())
        seq.append(tok)
        logprobs.append(float(lp[tok]))
    return seq[len(ids) :], logprobs


TIE = 2e-3
"""Logprob gap under which two tokens are a tie between vLLM's kernels and transformers' (the
logprob tolerance of :func:`assert_serves`): either may pick either."""


def assert_greedy(
    model: torch.nn.Module, ids: list[int], got_ids: list[int], got_lp: list[float] | None = None
) -> None:
    """``got_ids`` (vLLM's greedy tokens after ``ids``) are ``model``'s greedy choices, fed
    back as vLLM generated them (one forward): each token is transformers' top-1 or within
    :data:`TIE` of it, so a near-tie that the two kernels round apart cannot fail the check by
    chance (weights drawn by a sampled run, another CPU's numerics), while wrong weights still
    do; with ``got_lp``, vLLM's logprobs equal transformers' for those tokens within TIE."""
    seq = torch.tensor([[*ids, *got_ids]])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    chosen = lp[torch.arange(len(got_ids)), torch.tensor(got_ids)]
    gaps = (lp.max(-1).values - chosen).tolist()
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= TIE, (
        f"token {worst} ({got_ids[worst]}) is {gaps[worst]:.2e} below transformers' top-1 "
        f"{int(lp[worst].argmax())}: not its greedy choice"
    )
    if got_lp is not None:
        assert got_lp == pytest.approx(chosen.tolist(), abs=TIE)


def vllm_greedy(
    url: str, model: str, ids: list[int], n: int = N_TOKENS
) -> tuple[list[int], list[float], str]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
        },
        timeout=120,
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], r.headers[VERSION_HEADER]


def assert_serves(
    url: str, served: str, model: torch.nn.Module, ids: list[int], version: int
) -> None:
    got_ids, got_lp, header = vllm_greedy(url, served, ids)
    assert_greedy(model, ids, got_ids, got_lp)
    assert header == str(version)
    assert httpx.get(f"{url}/bridge/health").json()["weight_version"] == str(version)


class InFlight:
    """A long streamed completion that is decoding when the sync starts and still streaming
    after it returns, so it ran through the whole weight update on the version it started
    with: held by the pause of a sync that pauses (``mode="keep"``, vllm_patching/routes.py),
    served beside the hot-swap of one that does not (LoRA).

    The sync starts only once the first token has streamed back (not after a fixed sleep),
    and :meth:`check` closes the stream once a token has arrived after the sync returned, so
    the request never has to finish: ``n`` (1,500 tokens: 12 s at 120 tokens/s, the fastest
    a quiet box decodes the tiny model) only has to outlast the sync. A request that ended
    first fails the test with what it measured. (It was 300 tokens waited out in full and an
    assertion that they ended after the sync: a sync whose work before the pause outlasted
    them failed it, by the box's speed, twice; and before that, 1,500 and 500 tokens waited
    out in full.)
    """

    def __init__(self, url: str, model: str, ids: list[int], n: int = 1500) -> None:
        self.result: dict = {}
        self.chunks: list[float] = []
        """When each token arrived (monotonic s)."""
        self.decoding = threading.Event()
        self.close = threading.Event()

        def run() -> None:
            body = stream_body(model, ids, n)
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                    self.result["status"] = r.status_code
                    self.result["version"] = r.headers.get(VERSION_HEADER)
                    for line in r.iter_lines():
                        if self.close.is_set():
                            return  # leaving the block closes the stream: vLLM aborts it
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: ") :])
                        if chunk.get("choices"):
                            self.chunks.append(time.monotonic())
                            self.decoding.set()
                            if chunk["choices"][0].get("finish_reason"):
                                self.result["finish_reason"] = chunk["choices"][0]["finish_reason"]
            finally:
                self.decoding.set()  # never leave the constructor waiting on a failed request

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.decoding.wait(180), "the in-flight request never started decoding"

    def check(self, version_at_start: int) -> None:
        """Call it as soon as the sync returns: the request streams a token past the sync's
        return, on the version it started with, then the test closes it."""
        sync_ended_at = time.monotonic()
        deadline = sync_ended_at + 120
        while time.monotonic() < deadline and self.thread.is_alive():
            if any(t > sync_ended_at for t in self.chunks):
                break
            time.sleep(0.01)
        self.close.set()
        self.thread.join(60)
        assert self.result.get("status") == 200, self.result
        assert "finish_reason" not in self.result, (
            f"the request ended ({self.result.get('finish_reason')}, {len(self.chunks)} "
            "chunks) before the sync returned"
        )
        assert any(t > sync_ended_at for t in self.chunks), "no token streamed after the sync"
        assert self.result["version"] == str(version_at_start)

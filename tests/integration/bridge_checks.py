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
    """A long streamed completion that is decoding when the sync starts and still decoding
    when it returns, so it ran through the whole weight update.

    The sync starts only once the first token has streamed back (not after a fixed sleep:
    on an idle machine a short request could finish before the sync, on a loaded one it
    might not have started), and the request is long enough to outlast the sync: 300 tokens
    are 2.5-4.3 s of decoding for vLLM on the CPU at 70-120 tokens/s (the tiny model, measured
    on a quiet 2-core box; the Xeon box of docs/results/suite_speedups.md decoded a
    streamed request at 5-60 tokens/s, vLLM's throughput log), a sync of the tiny model well
    under a second, and a loaded box slows both. ``check`` asserts that the request outlived
    the sync (it asked only that it outlived the sync's start, which a request finished before
    the pause also did): a request too short for the box fails the test instead of passing
    unchecked. Where a sync sets up its transport before the pause (a bridge's first sync),
    the request goes through a later one. (It was 1,500 tokens, then 500: 4-7 s per request,
    six of them, waited out in full.)
    """

    def __init__(self, url: str, model: str, ids: list[int], n: int = 300) -> None:
        self.result: dict = {}
        self.n = n
        self.done_at = 0.0
        self.chunks: list[float] = []
        """When each token arrived (monotonic s)."""
        self.decoding = threading.Event()
        self.close = threading.Event()

        def run() -> None:
            body = {**stream_body(model, ids, n), "stream_options": {"include_usage": True}}
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
                        if chunk.get("usage"):
                            self.result["usage"] = chunk["usage"]
            finally:
                self.done_at = time.monotonic()
                self.decoding.set()  # never leave the constructor waiting on a failed request

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.decoding.wait(180), "the in-flight request never started decoding"

    def check(self, version_at_start: int) -> None:
        """Call it as soon as the sync returns. The request completed in full on the version
        it started with, and was still running when the sync returned, so through all of it
        (the syncs it is used with pause vLLM, which holds a request that is decoding)."""
        sync_ended_at = time.monotonic()
        self.thread.join(300)
        assert self.done_at > sync_ended_at, "the request did not overlap the sync"
        assert self.result["status"] == 200
        assert self.result["finish_reason"] == "length"
        assert self.result["usage"]["completion_tokens"] == self.n
        assert self.result["version"] == str(version_at_start)

    def check_still_streaming(self, version_at_start: int) -> None:
        """For a sync that does not pause (a LoRA hot-swap), which cannot hold a request: call
        it as soon as the sync returns. The request (``n`` far above what decodes during a
        sync: 1,500 tokens are 12 s at 120 tokens/s, a LoRA sync of the tiny model well under
        a second) streams a token past the sync's return, on the version it started with;
        then the test closes it, so it never has to finish. A request that ended first fails
        the test with what it measured (the LoRA test once asked only that one request of
        three outlive its sync)."""
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

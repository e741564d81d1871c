"""The embedded model serves in the real vLLM (CPU) with token ids and logprobs."""

from __future__ import annotations

import math

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration


def test_completion_with_logprobs_and_token_ids(vllm_server, tiny_model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Find running shoes under $50."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    r = httpx.post(
        f"{vllm_server.base_url}/v1/completions",
        json={
            "model": vllm_server.model,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 1234,
            "logprobs": 1,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    lps = choice["logprobs"]["token_logprobs"]
    assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
    assert all(math.isfinite(x) and x <= 0.0 for x in lps)
    assert all(0 <= i < len(tok) for i in ids)
    # The prompt the server tokenized is the one our tokenizer makes (same tokenizer files).
    assert choice["prompt_token_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    # Random weights give near-uniform logprobs: about -log(vocab).
    assert abs(sum(lps) / len(lps) + math.log(len(tok))) < 3.0

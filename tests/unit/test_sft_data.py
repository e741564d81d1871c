"""SFT examples (trainer/sft_data.py): encoded on several threads, the examples and their
order are those of one thread, and rows that cannot fit are left out of both alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from env_server.data.dataset import build_dataset
from trainer.sft_data import encode_example, encode_split

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("max_seq_len", [1024, 400])
def test_threaded_encoding_equals_one_thread(tiny_model_dir: Path, max_seq_len: int) -> None:
    rows = build_dataset(num_sessions=60, seed=0)["train"].to_list()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    one = [encode_example(r, tok, max_seq_len) for r in rows]
    kept = [e for e in one if e is not None]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        many = encode_split(rows, tok, max_seq_len, latest_only=False)
    finally:
        torch.set_num_threads(threads)
    assert len(kept) > 100
    if max_seq_len == 400:
        assert len(kept) < len(rows)  # some rows cannot fit: left out, the order kept
    assert [(e.tokens, e.loss_mask, e.prompt_len) for e in many] == [
        (e.tokens, e.loss_mask, e.prompt_len) for e in kept
    ]

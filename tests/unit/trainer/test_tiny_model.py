"""The embedded model builder: deterministic bytes, the right shape, loadable by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.tiny_model import TinyModelSpec, build_tiny_model, digest, is_built

pytestmark = pytest.mark.unit


def test_builds_same_bytes_twice(tmp_path: Path) -> None:
    spec = TinyModelSpec(corpus_sessions=60)
    a = build_tiny_model(tmp_path / "a", spec)
    b = build_tiny_model(tmp_path / "b", spec)
    da, db = digest(a), digest(b)
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(da)
    assert da == db
    # a different seed is a different model (the digest is not vacuous)
    c = build_tiny_model(tmp_path / "c", TinyModelSpec(corpus_sessions=60, seed=1))
    assert digest(c)["model.safetensors"] != da["model.safetensors"]
    assert is_built(a) and not is_built(tmp_path / "missing")


def test_shape_tokenizer_and_chat_template(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64 == cfg["head_dim"]
    assert cfg["tie_word_embeddings"] is True

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.get_output_embeddings().weight.data_ptr() == (
        model.get_input_embeddings().weight.data_ptr()
    )
    assert 1000 <= len(tok) <= 8192 and model.config.vocab_size == len(tok)

    # The corpus-trained BPE compresses Shop-R1 text well (far fewer tokens than bytes).
    text = '{"rationale": "I want to compare prices.", "action": {"type": "click", "name": "search_button"}}'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2.5

    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"

    with torch.no_grad():
        out = model(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(out.logits).all()

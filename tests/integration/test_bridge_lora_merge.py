"""A LoRA (peft) trainer with a full-weight bridge: the adapters are merged for the sync.

The real vLLM CPU server serves the base model; the trainer wraps it in a real peft LoRA
model, takes a real optimizer step on the adapters and syncs through ``shared_vllm
--single-copy``: vLLM then generates exactly what peft's own ``merge_and_unload`` model
generates (the same names and merge code serve the CUDA path, tests/unit/test_bridge_cuda.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integration.test_bridge_modes import (
    TOKEN,
    _server,
    assert_serves,
    hf_model,
    optimizer_step,
    prompt_ids,
)
from trainer.bridge import make_bridge

pytestmark = pytest.mark.integration


def test_lora_model_full_weight_sync_serves_the_merged_model(
    tiny_model_dir, tmp_path_factory
) -> None:
    from peft import LoraConfig, get_peft_model

    server = _server(tiny_model_dir, tmp_path_factory, "shared_vllm", single_copy=True)
    try:
        url, served = server.base_url, server.served_model_name
        ids = prompt_ids(tiny_model_dir)
        torch.manual_seed(0)
        model = get_peft_model(
            hf_model(tiny_model_dir), LoraConfig(r=8, lora_alpha=32, target_modules="all-linear")
        )
        optimizer_step(model, ids, lr=5e-2)  # the adapters move (B leaves zero)
        bridge = make_bridge("shared_vllm", [url], single_copy=True, token=TOKEN)
        try:
            bridge.sync(model, 1)
            merged = copy.deepcopy(model).merge_and_unload().eval()
            assert_serves(url, served, merged, ids, version=1)
            base = hf_model(tiny_model_dir)
            name = "model.layers.0.self_attn.q_proj.weight"
            assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])
        finally:
            bridge.close()
    finally:
        server.stop()

"""The packed prefix tree's contract on CUDA (issue 25): the same per-token logprobs, loss and
gradients as padded rows, as tests/unit/trainer/test_prefix_tree.py checks on the CPU.

On CUDA the tree's batched children go through torch's SDPA with a block mask (the CPU-only
``_cascade`` kernel is never chosen there), so these run the CUDA kernels of that path: fp32
within the CPU tests' tolerance, bf16 autocast close, full weights and LoRA, the SFT loss, and
the embedded tiny model at its real prompt length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.trainer.test_prefix_tree import (
    CASES,
    check_bf16_packed_step_is_close,
    check_packed_sft_loss_equals_padded,
    check_packed_step_equals_padded,
)
from tests.unit.trainer.test_prefix_tree_models import compare
from tests.unit.trainer.test_trainer_core import build_micro_model
from tests.unit.trainer.test_tree_attention_kernels import _tree_with_batched_children
from trainer.prefix_tree.attention import use_cascade

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


@pytest.fixture(autouse=True)
def _exact_fp32() -> None:
    """fp32 means fp32: no TF32 in the matmuls the equality compares."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_step_equals_padded_cuda(
    micro_model_dir: Path, tmp_path: Path, case: str, lora_r: int
) -> None:
    check_packed_step_equals_padded(micro_model_dir, tmp_path, case, lora_r, "cuda")


def test_bf16_packed_step_is_close_to_padded_cuda(micro_model_dir: Path, tmp_path: Path) -> None:
    check_bf16_packed_step_is_close(micro_model_dir, tmp_path, "cuda")


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
def test_packed_sft_loss_equals_padded_cuda(micro_model_dir: Path, lora_r: int) -> None:
    check_packed_sft_loss_equals_padded(micro_model_dir, lora_r, "cuda")


@pytest.mark.parametrize("lora_r", [0, 8], ids=["full", "lora"])
def test_tiny_model_packed_equals_padded_cuda(
    tiny_model_dir: Path, tmp_path: Path, lora_r: int
) -> None:
    compare(tiny_model_dir, tmp_path, lora_r, prompt_len=400, comp_len=48, device="cuda")


def test_cascade_is_never_chosen_on_cuda() -> None:
    _, sets = _tree_with_batched_children()
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert use_cascade(bf16, sets[0], 0.0)  # on the CPU it would be
    assert not use_cascade(bf16.cuda(), sets[0], 0.0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert not use_cascade(torch.zeros(1, device="cuda"), sets[0], 0.0)

"""``freeze_layers``: the bottom layers get no gradient and no optimizer state, the backward
stops above them, and the layers above get exactly the gradients of the unfrozen model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.trainer.test_trainer_core import VOCAB, build_micro_model
from trainer.config import SftConfig
from trainer.forward import target_nll
from trainer.model import load_model
from trainer.optim import build_optimizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


def _grads(model_dir: Path, freeze: int) -> tuple[dict[str, torch.Tensor | None], int]:
    cfg = SftConfig(model_name=str(model_dir), precision="fp32", freeze_layers=freeze)
    lm = load_model(cfg)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB - 2, (12,), generator=g).tolist() for _ in range(3)]
    masks = [[0] * 6 + [1] * 6 for _ in seqs]
    target_nll(lm.model, seqs, masks, lm.device, lm.tree_attention, 4, 0).backward()
    opt = build_optimizer(lm.model, cfg)
    n_opt = sum(p.numel() for group in opt.param_groups for p in group["params"])
    return {n: p.grad for n, p in lm.model.named_parameters()}, n_opt


def test_frozen_layers_get_nothing_and_the_rest_is_unchanged(micro_model_dir: Path) -> None:
    full, n_full = _grads(micro_model_dir, 0)
    part, n_part = _grads(micro_model_dir, 1)
    assert n_part < n_full
    for name, g in part.items():
        if ".layers.0." in name:
            assert g is None, name  # frozen: no gradient at all
        elif "embed_tokens" in name:  # tied with the head: trains through the head only
            assert g is not None and not torch.equal(g, full[name])
        else:
            assert g is not None and torch.allclose(g, full[name], atol=1e-7), name
    with pytest.raises(ValueError, match="nothing to train"):
        _grads(micro_model_dir, 2)

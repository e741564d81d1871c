"""bench/peers/same_batch.py's pure parts: how a sampled completion is cut, and the cosines
(the comparison against TRL itself runs in tests/integration/bench/test_same_batch.py)."""

from __future__ import annotations

import pytest
import torch

from bench.peers.same_batch import adam_first_step, cosines, truncate_at_eos

pytestmark = pytest.mark.unit


def test_a_completion_ends_at_its_first_eos() -> None:
    assert truncate_at_eos([5, 6, 2, 0, 0], eos=[2], pad=0) == [5, 6, 2]
    assert truncate_at_eos([5, 2, 7, 2], eos=[2, 7], pad=None) == [5, 2]
    assert truncate_at_eos([5, 6, 0, 0], eos=[2], pad=0) == [5, 6]  # the budget ran out
    assert truncate_at_eos([5, 6, 2, 2], eos=[2], pad=2) == [5, 6, 2]  # pad is EOS


def test_cosines_over_the_model_and_per_tensor() -> None:
    a = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([2.0, 0.0]), "b": torch.tensor([-3.0])}
    got = cosines(a, b)
    assert got["cosine"] == pytest.approx((2 - 9) / (10**0.5 * 13**0.5))
    assert (got["norm_ours"], got["norm_trl"]) == pytest.approx((10**0.5, 13**0.5))
    assert got["tensor_cosine_min"] == pytest.approx(-1.0) and got["worst_tensor"] == "b"
    assert got["tensor_cosine_median"] == pytest.approx(0.0)  # the median of 1 and -1
    assert got["tensors"] == got["tensors_nonzero_in_both"] == 2
    b["w"] = torch.zeros(2)  # a tensor without a gradient on one side is left out per tensor
    assert cosines(a, b)["tensors_nonzero_in_both"] == 1
    with pytest.raises(ValueError, match="different tensors"):
        cosines(a, {"w": b["w"]})
    with pytest.raises(ValueError, match="no learning signal"):
        cosines(a, {"w": torch.zeros(2), "b": torch.zeros(1)})


def test_adams_first_step_is_a_sign_but_near_eps() -> None:
    g = {"w": torch.tensor([2.0, -3.0, 1e-8, 0.0])}
    got = adam_first_step(g, eps=1e-8)["w"]
    assert got.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.0], rel=1e-6)

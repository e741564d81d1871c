"""The loss options of trainer/loss.py (issue 28) against hand-computed values: GSPO, CISPO,
ICEPOP/MIS masking, sequence-level truncated IS, k1/k2/k3 KL, per-token advantages and the
trainer/inference mismatch metric. One fp32 micro-batch each; gradients are d loss / d logprob."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from trainer.config import GrpoConfig
from trainer.loss import kl_estimate, mismatch_kl
from trainer.policy_losses import policy_loss

pytestmark = pytest.mark.unit
LN = math.log


def _run(ratios: list[list[float]], adv, mask=None, inf=0.4, **kw):
    """Loss, gradient and sums for tokens whose trainer/inference ratio is ``ratios``."""
    r = torch.tensor(ratios, dtype=torch.float64).float()
    inference = torch.full_like(r, math.log(inf))
    lp = (inference + r.log()).clone().requires_grad_(True)
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float32)
    kw.setdefault("normaliser", float(m.sum()))
    out = policy_loss(lp, inference, torch.as_tensor(adv, dtype=torch.float32), m, **kw)
    out.loss.backward()
    return float(out.loss), lp.grad[0].tolist() if lp.grad.shape[0] == 1 else lp.grad, out.sums


# -- KL estimators ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        ("k1", 0.2, 1.0),  # d = log pi - log ref = 0.2; d/d(log pi) = 1
        ("k2", 0.02, 0.2),  # d^2 / 2; gradient d
        ("k3", math.exp(-0.2) + 0.2 - 1, 1 - math.exp(-0.2)),  # 0.018731, 0.181269
    ],
)
def test_kl_estimators_value_and_gradient(estimator: str, value: float, grad: float) -> None:
    lp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.2]])
    k = kl_estimate(lp, ref, estimator)
    assert float(k.detach()) == pytest.approx(value, rel=1e-5)
    k.sum().backward()
    assert float(lp.grad) == pytest.approx(grad, rel=1e-5)
    # in the loss: A = 0, so the loss is kl_beta * k on one token
    lp2 = torch.tensor([[-1.0]], requires_grad=True)
    out = policy_loss(
        lp2,
        torch.tensor([[-1.0]]),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        normaliser=1.0,
        ref_logprobs=ref,
        kl_beta=0.5,
        kl_estimator=estimator,
    )
    out.loss.backward()
    assert float(out.loss) == pytest.approx(0.5 * value, rel=1e-5)
    assert float(lp2.grad) == pytest.approx(0.5 * grad, rel=1e-5)
    assert out.sums["kl"] == pytest.approx(value, rel=1e-5)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")  # type: ignore[arg-type]


def test_mismatch_kl_k1_and_k3_over_masked_tokens() -> None:
    trainer = torch.tensor([[LN(0.5), LN(0.1), LN(0.3)]])
    inference = torch.tensor([[LN(0.4), LN(0.2), LN(0.9)]])  # r = 1.25, 0.5; third masked
    sums = mismatch_kl(trainer, inference, torch.tensor([[1, 1, 0]]))
    k1 = -(LN(1.25) + LN(0.5))  # 0.470004
    k3 = (1.25 - LN(1.25) - 1) + (0.5 - LN(0.5) - 1)  # 0.026856 + 0.193147
    assert sums["mismatch_k1"] == pytest.approx(k1, rel=1e-5)
    assert sums["mismatch_k3"] == pytest.approx(k3, rel=1e-5)
    assert sums["mismatch_tokens"] == 2.0


# -- GSPO ------------------------------------------------------------------------------------


def test_gspo_uses_the_sequence_ratio_where_ppo_clips_a_token() -> None:
    """Token ratios 1.3 and 1/1.3: PPO (clip 0.2, A = 1) clips the first token (no gradient);
    GSPO's sequence ratio is their geometric mean, exactly 1, so both tokens get -s A / 2."""
    ppo_loss, ppo_grad, ppo = _run([[1.3, 1 / 1.3]], [1.0])
    assert ppo_loss == pytest.approx(-(1.2 + 1 / 1.3) / 2, rel=1e-5)
    assert ppo_grad == pytest.approx([0.0, -(1 / 1.3) / 2], rel=1e-5)
    assert ppo["clipped"] == 1
    loss, grad, sums = _run([[1.3, 1 / 1.3]], [1.0], loss_type="gspo")
    assert loss == pytest.approx(-1.0, rel=1e-5)
    assert grad == pytest.approx([-0.5, -0.5], rel=1e-5)
    assert sums["clipped"] == 0 and sums["ratio"] == pytest.approx(2.0, rel=1e-5)


def test_gspo_clips_the_whole_sequence() -> None:
    """Ratios 1.1 and 1.3: s = sqrt(1.43) = 1.195826. Under clip_high 0.2 nothing is clipped
    (loss -s, gradient -s/2 on each token); under clip_high 0.1 (s > 1.1) the sequence is clipped
    as a whole: loss -1.1, no gradient, both tokens counted as clipped."""
    s = math.sqrt(1.1 * 1.3)
    loss, grad, _ = _run([[1.1, 1.3]], [1.0], loss_type="gspo")
    assert loss == pytest.approx(-s, rel=1e-5)
    assert grad == pytest.approx([-s / 2, -s / 2], rel=1e-5)
    loss, grad, sums = _run([[1.1, 1.3]], [1.0], loss_type="gspo", clip_high=0.1)
    assert loss == pytest.approx(-1.1, rel=1e-5)
    assert grad == pytest.approx([0.0, 0.0], abs=1e-7)
    assert sums["clipped"] == 2


def test_gspo_sequence_aggregation_weights_each_sequence_once() -> None:
    """Two sequences of 1 and 3 tokens, ratio 1, A = +1 and -1, ``aggregation="sequence"``
    (the GSPO paper's): each sequence's mean is +-1, so the loss is (-1 + 1) / 2 = 0 and the
    gradient is -1/2 on the lone token and +1/6 on each of the three."""
    loss, grad, _ = _run(
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]],
        [1.0, -1.0],
        mask=[[1, 0, 0], [1, 1, 1]],
        normaliser=2.0,
        aggregation="sequence",
        loss_type="gspo",
    )
    assert loss == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))


# -- CISPO -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "adv", "cispo_grad", "ppo_grad"),
    [
        (1.1, 1.0, -1.1, -1.1),  # inside the clip range: the same gradient as PPO
        (1.5, 1.0, -1.2, 0.0),  # PPO drops the token, CISPO keeps it with weight 1 + 0.2
        (0.5, -1.0, 0.8, 0.0),  # A < 0 below 1 - 0.2: weight 0.8
        (0.9, -2.0, 1.8, 1.8),
    ],
)
def test_cispo_clips_the_weight_and_drops_no_token(
    ratio: float, adv: float, cispo_grad: float, ppo_grad: float
) -> None:
    _, grad, sums = _run([[ratio]], [adv], loss_type="cispo")
    assert grad == pytest.approx([cispo_grad], rel=1e-5)
    _, grad_ppo, _ = _run([[ratio]], [adv])
    assert grad_ppo == pytest.approx([ppo_grad], abs=1e-7)
    assert sums["clipped"] == float(not 0.8 <= ratio <= 1.2)


def test_cispo_loss_value_is_weight_times_advantage_times_logprob() -> None:
    loss, _, _ = _run([[1.5]], [2.0], loss_type="cispo", inf=0.4)
    assert loss == pytest.approx(-1.2 * 2.0 * math.log(0.6), rel=1e-5)  # log pi = log(1.5 * 0.4)


# -- ICEPOP / MIS masking and sequence-level truncated IS --------------------------------


def test_icepop_masks_tokens_outside_the_ratio_bounds() -> None:
    """Trainer/inference ratios 0.4, 1.0, 3.0 with bounds [0.5, 2]: only the middle token has
    a policy term (-1 / 3 tokens in the normaliser); the masked ones keep their KL term."""
    loss, grad, sums = _run([[0.4, 1.0, 3.0]], [1.0], mask_low=0.5, mask_high=2.0)
    assert loss == pytest.approx(-1 / 3, rel=1e-5)
    assert grad == pytest.approx([0.0, -1 / 3, 0.0], abs=1e-7)
    assert sums["mismatch_masked"] == 2
    # decoupled (TIS on): the same mask on pi_old / pi_inference, ratio pi / pi_old = 1
    loss, grad, _ = _run([[0.4, 1.0, 3.0]], [1.0], mask_low=0.5, mask_high=2.0, tis_cap=10.0)
    assert grad == pytest.approx([0.0, -1 / 3, 0.0], abs=1e-7)
    # KL stays on masked tokens: ref = log pi - 0.2 everywhere, k1 = 0.2 on each of 3 tokens
    r = torch.tensor([[0.4, 1.0, 3.0]])
    inference = torch.full_like(r, math.log(0.4))
    lp = inference + r.log()
    out = policy_loss(
        lp,
        inference,
        torch.tensor([0.0]),
        torch.ones_like(r),
        normaliser=3.0,
        ref_logprobs=lp - 0.2,
        kl_beta=1.0,
        kl_estimator="k1",
        mask_low=0.5,
        mask_high=2.0,
    )
    assert float(out.loss) == pytest.approx(0.2, rel=1e-5)
    only_high = _run([[0.4, 1.0, 3.0]], [1.0], mask_high=2.0)[2]
    assert only_high["mismatch_masked"] == 1


def test_sequence_level_truncated_importance_weight() -> None:
    """TIS on (decoupled: ratio pi / pi_old = 1, A = 1). Row 1's trainer/inference ratios 2
    and 1.5 multiply to 3, truncated at 2.5 on both tokens; row 2's 0.5 x 1.2 = 0.6 stays.
    Token level, row 1 keeps 2 and 1.5 (under the cap)."""
    ratios = [[2.0, 1.5], [0.5, 1.2]]
    loss, grad, sums = _run(ratios, [1.0, 1.0], tis_cap=2.5, tis_level="sequence")
    assert loss == pytest.approx(-(2.5 * 2 + 0.6 * 2) / 4, rel=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-2.5, -2.5], [-0.6, -0.6]]) / 4)
    assert sums["iw_truncated"] == 2 and sums["iw"] == pytest.approx(3 * 2 + 0.6 * 2, rel=1e-5)
    loss, grad, sums = _run(ratios, [1.0, 1.0], tis_cap=2.5, tis_level="token")
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -1.5], [-0.5, -1.2]]) / 4)
    assert sums["iw_truncated"] == 0


# -- per-token advantages ------------------------------------------------------------------


def test_per_token_advantages() -> None:
    """A [B, T] advantage (an environment's own): ratio 1, advantages +1 and -2 on two tokens:
    loss -(1 - 2) / 2 = 0.5, gradient -1/2 and +1."""
    loss, grad, _ = _run([[1.0, 1.0]], [[1.0, -2.0]])
    assert loss == pytest.approx(0.5, rel=1e-5)
    assert grad == pytest.approx([-0.5, 1.0], rel=1e-5)


# -- config ----------------------------------------------------------------------------------


def test_config_values_and_their_checks() -> None:
    cfg = GrpoConfig(
        policy_loss="gspo",
        kl_estimator="k2",
        tis_cap=2.0,
        tis_level="sequence",
        mismatch_mask_low=0.5,
        mismatch_mask_high=5.0,
    )
    assert (cfg.loss.type, cfg.kl_estimator, cfg.loss.tis_level) == ("gspo", "k2", "sequence")
    with pytest.raises(ValidationError, match="tis_level sequence needs tis_cap"):
        GrpoConfig(tis_level="sequence")
    with pytest.raises(ValidationError, match="mismatch_mask_low"):
        GrpoConfig(mismatch_mask_low=1.5)
    with pytest.raises(ValidationError, match="mismatch_mask_high"):
        GrpoConfig(mismatch_mask_high=0.9)
    with pytest.raises(ValidationError, match="policy_loss"):
        GrpoConfig(policy_loss="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown loss_type"):
        _run([[1.0]], [1.0], loss_type="sapo")

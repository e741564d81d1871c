"""The GRPO maths against hand-computed values (CPU, fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (
    group_advantages,
    kl_k3,
    self_certainty,
    sft_loss,
    token_stats,
)
from trainer.policy_losses import policy_loss

pytestmark = pytest.mark.unit


def test_group_advantages_population_std_and_constant_groups() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7, 0.7, 3.0, 1.0])
    groups = torch.tensor([5, 5, 5, 5, 9, 9, 2, 2])
    adv = group_advantages(scores, groups, eps=1e-6)
    # group 5: mean 0.5, population std 0.5 -> +-0.5 / 0.5 = +-1 (sample std would give 0.866).
    expected_5 = torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(adv[:4], expected_5)
    torch.testing.assert_close(adv[4:6], torch.zeros(2))  # all equal -> no signal, not NaN
    # group 2: mean 2, population std 1.
    torch.testing.assert_close(adv[6:], torch.tensor([1.0, -1.0]) / (1.0 + 1e-6))


def test_unscaled_advantages_weigh_groups_by_their_reward_spread() -> None:
    """Dr. GRPO: only the group mean is subtracted, so a group with one large (DARS-like)
    reward outweighs a group whose rewards differ by small credits; scaled, both count alike."""
    scores = torch.tensor([1000.8, 0.8, 0.8, 0.8, 0.8, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    raw = group_advantages(scores, groups, scale=False)
    torch.testing.assert_close(raw[:4], torch.tensor([750.0, -250.0, -250.0, -250.0]))
    torch.testing.assert_close(raw[4:], torch.tensor([0.225, -0.075, -0.075, -0.075]))
    scaled = group_advantages(scores, groups)
    torch.testing.assert_close(scaled[0], scaled[4], rtol=1e-4, atol=1e-4)  # same, however large


def test_token_stats_temperature_matches_scaled_softmax() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 0.0]]])  # [1, 2, 2]
    tokens = torch.tensor([[0, 1]])  # predict tokens[1] = 1 from logits[0]
    stats = token_stats(logits, tokens, temperature=1.0)
    assert stats.logprobs.shape == (1, 1)
    torch.testing.assert_close(stats.logprobs, torch.tensor([[math.log(0.75)]]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(stats.entropy, torch.tensor([[h]]))
    # T = 2: softmax([0, ln3 / 2]) -> p1 = sqrt(3) / (1 + sqrt(3))
    hot = token_stats(logits, tokens, temperature=2.0)
    p1 = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))
    torch.testing.assert_close(hot.logprobs, torch.tensor([[math.log(p1)]]))
    with pytest.raises(ValueError):
        token_stats(logits, tokens, temperature=0.0)


def test_self_certainty_is_kl_to_uniform_over_span() -> None:
    # p = [1/4, 3/4] -> KL(p || U2) = 0.25 ln 0.5 + 0.75 ln 1.5 = 0.130812...
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [0.0, math.log(3.0)]]])
    tokens = torch.tensor([[1, 1, 1]])
    ent = token_stats(logits, tokens).entropy  # [1, 2]: positions 0 (peaked) and 1 (uniform)
    kl_peaked = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    only_peaked = self_certainty(ent, torch.tensor([[1, 0]]), vocab_size=2)
    torch.testing.assert_close(only_peaked, torch.tensor([kl_peaked]))
    both = self_certainty(ent, torch.tensor([[1, 1]]), vocab_size=2)  # uniform adds 0
    torch.testing.assert_close(both, torch.tensor([kl_peaked / 2]))
    torch.testing.assert_close(
        self_certainty(ent, torch.tensor([[0, 0]]), vocab_size=2), torch.tensor([0.0])
    )


def _one_token(ratio: float, adv: float, **kw: object) -> tuple[float, float]:
    """Loss and d loss / d logprob for one token with the given ratio to the inference lp."""
    inf = torch.tensor([[math.log(0.4)]])
    lp = (inf + math.log(ratio)).clone().requires_grad_(True)
    out = policy_loss(lp, inf, torch.tensor([adv]), torch.ones(1, 1), normaliser=1.0, **kw)
    out.loss.backward()
    return float(out.loss.detach()), float(lp.grad[0, 0])


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped"),
    [
        (1.0, 1.0, -1.0, -1.0, 0),  # on-policy: gradient = -A
        (1.5, 1.0, -1.2, 0.0, 1),  # A > 0, ratio above 1 + eps: flat (clipped)
        (0.5, 1.0, -0.5, -0.5, 0),  # A > 0, ratio below 1 - eps: NOT clipped (pessimistic)
        (0.5, -1.0, 0.8, 0.0, 1),  # A < 0, ratio below 1 - eps: flat (clipped)
        (1.5, -1.0, 1.5, 1.5, 0),  # A < 0, ratio above 1 + eps: NOT clipped, grad = -A * ratio
        (1.2, 1.0, -1.2, -1.2, 0),  # exactly on the boundary: still the unclipped branch
    ],
)
def test_ppo_clip_both_signs(ratio: float, adv: float, loss: float, grad: float, clipped: int):
    got_loss, got_grad = _one_token(ratio, adv, clip_low=0.2, clip_high=0.2)
    assert got_loss == pytest.approx(loss, abs=1e-5)
    assert got_grad == pytest.approx(grad, abs=1e-5)
    inf = torch.tensor([[math.log(0.4)]])
    out = policy_loss(
        inf + math.log(ratio), inf, torch.tensor([adv]), torch.ones(1, 1), normaliser=1.0
    )
    assert out.sums["clipped"] == clipped


def test_asymmetric_clip_high() -> None:
    # clip_high = 0.28 (DAPO-style): ratio 1.25 with A > 0 is inside the range.
    loss, grad = _one_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.25, abs=1e-5), pytest.approx(-1.25, abs=1e-5))


def test_truncated_importance_weight() -> None:
    # Trainer lp = ln 0.5, inference lp = ln 0.1 -> pi_old / pi_inf = 5, truncated to 2.
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    inf = torch.tensor([[math.log(0.1), math.log(0.4)]])
    out = policy_loss(lp, inf, torch.tensor([1.0]), torch.ones(1, 2), normaliser=2.0, tis_cap=2.0)
    out.loss.backward()
    # ratio to the trainer's own (detached) lp is 1 -> loss = -(2 * 1 + 1.25 * 1) / 2
    assert float(out.loss.detach()) == pytest.approx(-(2.0 + 1.25) / 2, abs=1e-5)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.625]]))
    assert out.sums["iw_truncated"] == 1
    assert out.sums["iw"] == pytest.approx(5.0 + 1.25, abs=1e-4)


def test_k3_kl_value_gradient_and_in_loss() -> None:
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # r = ln 0.5 -> exp(r) - r - 1 = 0.5 + ln 2 - 1
    assert float(kl_k3(lp, ref)) == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert float(kl_k3(ref, ref)) == 0.0
    # In the loss with A = 0 only the KL term is left: beta * k3, gradient beta * (1 - exp(r)).
    lp2 = torch.tensor([[math.log(0.5)]], requires_grad=True)
    out = policy_loss(
        lp2,
        lp2.detach(),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        normaliser=1.0,
        ref_logprobs=ref.view(1, 1),
        kl_beta=0.1,
    )
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-6)
    assert float(lp2.grad) == pytest.approx(0.1 * (1 - 0.5), abs=1e-6)
    assert out.sums["kl"] == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)


def test_token_vs_sequence_aggregation_and_masking() -> None:
    # seq 0: one trainable token, seq 1: three; on-policy so per-token loss = -A.
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    inf = lp.clone()
    inf[0, 1:] = -50.0  # garbage under the mask must not leak (no inf * 0 = NaN)
    adv = torch.tensor([2.0, -1.0])
    tok = policy_loss(lp, inf, adv, mask, normaliser=4.0, aggregation="token")
    assert float(tok.loss) == pytest.approx((-2.0 + 3 * 1.0) / 4)
    seq = policy_loss(lp, inf, adv, mask, normaliser=2.0, aggregation="sequence")
    assert float(seq.loss) == pytest.approx((-2.0 + 1.0) / 2)
    assert tok.sums["tokens"] == 4
    with pytest.raises(ValueError):
        policy_loss(lp, inf, adv, mask, normaliser=0.0)


def test_accumulated_microbatches_equal_one_batch() -> None:
    torch.manual_seed(0)
    lp = torch.randn(4, 6)
    inf = lp + 0.1 * torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).long()
    adv = torch.randn(4)
    whole = policy_loss(lp, inf, adv, mask, normaliser=float(mask.sum()))
    parts = sum(
        policy_loss(
            lp[i : i + 2],
            inf[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            normaliser=float(mask.sum()),
        ).loss
        for i in (0, 2)
    )
    torch.testing.assert_close(whole.loss, parts)


def test_sft_loss_masks_prompt() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 1, 2] = math.log(3.0)  # p(2) at position 1 = 3 / 6 = 0.5
    tokens = torch.tensor([[0, 1, 2]])
    loss_mask = torch.tensor([[0, 0, 1]])  # only tokens[2] is a target
    loss, nll = sft_loss(logits, tokens, loss_mask, normaliser=1.0)
    assert float(loss) == pytest.approx(-math.log(0.5), abs=1e-6)
    assert nll == pytest.approx(-math.log(0.5), abs=1e-6)

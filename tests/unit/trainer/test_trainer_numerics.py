"""Numerical safety of the GRPO maths (issue 21, items 3 and 4), with the issue's exact
reproductions: an inference logprob of -1e4 (env_server/inference.py's stand-in for -inf)
with TIS off, for both signs of the advantage; a non-finite gradient skips the update without
moving the weights, the optimizer or the schedule; constant groups get advantage exactly 0
(eight rewards of 801.1 in float32 gave |A| up to 0.98)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.trainer.test_trainer_core import _grpo_cfg, _params, build_micro_model, make_groups
from trainer.batch import flatten_groups
from trainer.grpo_step import StepContext, grpo_step
from trainer.loss import LOG_RATIO_BOUND, group_advantages, kl_k3
from trainer.model import Reference, load_model
from trainer.optim import build_optimizer, build_scheduler, clip_and_step
from trainer.policy_losses import policy_loss

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


# -- item 3: the importance ratio --------------------------------------------------------


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_inference_logprob_minus_1e4_gives_a_finite_loss_and_gradient(
    advantage: float, tis_cap: float | None
) -> None:
    """TIS off: ratio = exp(logp - (-1e4)) overflowed to inf -> NaN gradient (A > 0) or inf
    loss (A < 0). Clamped in log space, the token gets a finite term and no gradient, and the
    other tokens get exactly the gradient they get without it."""
    assert math.isinf(torch.exp(torch.tensor(-2.0 + 1e4)).item())  # the overflow is real
    logp = torch.tensor([[-2.0, -1.0, -0.5]], requires_grad=True)
    inference = torch.tensor([[-1e4, -1.1, -0.4]])
    mask = torch.ones(1, 3)
    out = policy_loss(
        logp, inference, torch.tensor([advantage]), mask, normaliser=3.0, tis_cap=tis_cap
    )
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())), out.loss
    assert torch.isfinite(logp.grad).all(), logp.grad
    assert all(math.isfinite(v) for v in out.sums.values()), out.sums
    if tis_cap is None:
        assert logp.grad[0, 0] == 0.0  # beyond the bound: no gradient from that token
        alone = logp.detach()[:, 1:].clone().requires_grad_(True)
        policy_loss(
            alone, inference[:, 1:], torch.tensor([advantage]), mask[:, 1:], normaliser=3.0
        ).loss.backward()
        torch.testing.assert_close(logp.grad[:, 1:], alone.grad)


def test_ratios_within_the_bound_are_untouched() -> None:
    """The clamp only acts beyond +-LOG_RATIO_BOUND: an ordinary ratio is exp(logp - old)."""
    logp = torch.tensor([[-1.0, -3.0]])
    inference = torch.tensor([[-1.5, -3.0 + LOG_RATIO_BOUND - 1.0]])
    out = policy_loss(logp, inference, torch.tensor([1.0]), torch.ones(1, 2), normaliser=1.0)
    expected = math.exp(0.5) + math.exp(-(LOG_RATIO_BOUND - 1.0))
    assert out.sums["ratio"] == pytest.approx(expected, rel=1e-6)


def test_k3_is_finite_for_a_huge_log_ratio() -> None:
    k = kl_k3(torch.tensor([-1e4, -1.0]), torch.tensor([-1.0, -1e4]))
    assert torch.isfinite(k).all() and (k >= 0).all()


def test_grpo_step_with_a_minus_1e4_inference_logprob_trains(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    """The same reproduction through a real GRPO step (TIS off): the update is applied."""
    cfg = _grpo_cfg(micro_model_dir, tmp_path)
    assert cfg.loss.tis_cap is None
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    ctx = StepContext(lm, Reference(lm), opt, build_scheduler(opt, cfg), cfg)
    groups = make_groups(seed=1)
    for g in groups:  # A > 0 and A < 0 members alike get a -1e4 inference logprob
        for s in g.sequences:
            s.logprobs[-2] = -1e4
    before = _params(lm.model)
    stats = grpo_step(ctx, flatten_groups(groups, cfg.max_seq_len)[0])
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"]), stats
    after = _params(lm.model)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)


# -- item 3: a skipped update moves nothing ----------------------------------------------


def test_a_non_finite_gradient_moves_no_weight_no_moment_no_schedule(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _grpo_cfg(micro_model_dir, tmp_path, warmup_steps=3)
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    sched = build_scheduler(opt, cfg)
    before, lr = _params(lm.model), sched.get_last_lr()
    for p in lm.model.parameters():
        p.grad = torch.ones_like(p)
    next(lm.model.parameters()).grad[0].fill_(float("nan"))
    assert math.isnan(clip_and_step(lm.model, opt, sched, cfg.max_grad_norm))
    assert all(torch.equal(v, before[k]) for k, v in _params(lm.model).items())
    assert opt.state_dict()["state"] == {} and sched.last_epoch == 0 and sched.get_last_lr() == lr
    assert all(p.grad is None for p in lm.model.parameters())  # nothing carried into the next


def test_grpo_step_on_overflowing_rewards_is_skipped_not_applied(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    """Finite but huge rewards (the API accepts any finite score) overflow the fp32 gradient
    under Dr. GRPO: grpo_step reports the non-finite norm and the weights stay as they were
    (trainer/grpo.py then marks the batch skipped; tests/integration/trainer/test_trainer_grpo.py)."""
    cfg = _grpo_cfg(micro_model_dir, tmp_path, scale_advantages=False)
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    sched = build_scheduler(opt, cfg)
    ctx = StepContext(lm, Reference(lm), opt, sched, cfg)
    groups = make_groups(seed=1)
    for g in groups:
        for i, s in enumerate(g.sequences):
            s.score = 3e38 if i % 2 == 0 else -3e38
    before = _params(lm.model)
    stats = grpo_step(ctx, flatten_groups(groups, cfg.max_seq_len)[0])
    assert not math.isfinite(stats["grad_norm"])
    assert all(torch.equal(v, before[k]) for k, v in _params(lm.model).items())
    assert sched.last_epoch == 0


# -- item 4: constant groups -------------------------------------------------------------


@pytest.mark.parametrize("scale", [True, False])
def test_eight_rewards_of_801_1_get_exactly_zero(scale: bool) -> None:
    scores = torch.full((8,), 801.1, dtype=torch.float32)
    adv = group_advantages(scores, torch.zeros(8, dtype=torch.long), scale=scale)
    assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(8)), adv


@pytest.mark.parametrize(("value", "size"), [(1001.1, n) for n in range(3, 17)] + [(0.8, 7)])
def test_the_issues_other_constant_groups_get_exactly_zero(value: float, size: int) -> None:
    scores = torch.full((size,), value, dtype=torch.float32)
    for scale in (True, False):
        adv = group_advantages(scores, torch.zeros(size, dtype=torch.long), scale=scale)
        assert torch.equal(adv, torch.zeros(size)), (value, size, adv)


_reward = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@settings(max_examples=300, deadline=None)
@given(
    constant=st.lists(st.tuples(_reward, st.integers(3, 16)), min_size=1, max_size=4),
    varied=st.lists(st.lists(_reward, min_size=2, max_size=16, unique=True), max_size=3),
    scale=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_constant_groups_get_zero_beside_any_other_group(
    constant: list[tuple[float, int]], varied: list[list[float]], scale: bool, dtype: torch.dtype
) -> None:
    """The docstring's promise for any value and group size 3..16, scaled or not (Dr. GRPO),
    in a batch that also holds non-constant groups (whose advantages stay finite, centred)."""
    scores, labels, is_constant = [], [], []
    for gi, (value, size) in enumerate(constant):
        scores += [value] * size
        labels += [gi] * size
        is_constant += [True] * size
    for gi, values in enumerate(varied, start=len(constant)):
        scores += values
        labels += [gi] * len(values)
        is_constant += [False] * len(values)
    adv = group_advantages(torch.tensor(scores, dtype=dtype), torch.tensor(labels), scale=scale)
    flat = torch.tensor(is_constant)
    assert torch.equal(adv[flat], torch.zeros(int(flat.sum()))), adv
    assert torch.isfinite(adv).all()
    for gi in range(len(constant), len(constant) + len(varied)):
        members = adv[torch.tensor(labels) == gi].double()
        assert abs(float(members.sum())) <= 1e-5 * max(1.0, float(members.abs().max()))
        assert (members != 0).any()

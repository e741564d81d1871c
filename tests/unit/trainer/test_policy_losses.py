"""The policy-loss registry of trainer/policy_losses.py (issue 47): the registered names are
the config's, an unknown one is refused naming them, a new loss is one registered function,
the settings come from GrpoConfig field by field, and five cases keep the values (loss,
gradient, every sum) that the single ``policy_loss`` function gave before the registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config import GrpoConfig
from trainer.loss_config import LOSS_TYPES
from trainer.policy_losses import (
    LOSSES,
    LossInput,
    LossOutput,
    LossSettings,
    compute_loss,
    finish,
    get_loss,
    importance,
    register,
)

pytestmark = pytest.mark.unit

LP = [[-0.9, -1.6, -0.3, -2.2], [-0.5, -1.1, -3.0, -0.7]]
INF = [[-1.2, -1.5, -0.1, -1e4], [-0.45, -1.6, -2.5, -50.0]]  # -1e4: inference's -inf
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]  # -50 under the mask must not leak
REF_SHIFT = [[0.1, -0.3, 0.2, 0.05], [0.4, 0.0, -0.2, 0.3]]  # log pi - log ref
SEQ_ADV = [1.3, -0.7]
TOKEN_ADV = [[1.3, -0.2, 0.5, 2.0], [-0.7, 0.9, -1.1, 0.0]]


def _inputs(adv: list, kl: bool, aggregation: str) -> tuple[LossInput, torch.Tensor]:
    lp = torch.tensor(LP, requires_grad=True)
    mask = torch.tensor(MASK)
    normaliser = float(mask.sum()) if aggregation == "token" else float(mask.shape[0])
    ref = torch.tensor(LP) - torch.tensor(REF_SHIFT) if kl else None
    inp = LossInput(lp, torch.tensor(INF), torch.tensor(adv), mask, normaliser, ref)
    return inp, lp


# Outputs of trainer/loss.py's policy_loss at 786ee65 (before the registry), fp32 on CPU.
PINNED = {
    "ppo_token_k3": (
        SEQ_ADV,
        True,
        dict(clip_low=0.2, clip_high=0.28, kl_beta=0.1, kl_estimator="k3"),
        -0.45314785838127136,
        [
            [
                0.0013594664633274078,
                -0.17303921282291412,
                -0.14946043491363525,
                0.0006967224180698395,
            ],
            [0.09983265399932861, 0.16487212479114532, -0.0031628962606191635, 0.0],
        ],
        dict(clipped=3.0, kl=0.16637909412384033, ratio=485165184.0, iw=7.0, iw_truncated=0.0),
    ),
    "ppo_sequence_tis_mask_k1": (
        SEQ_ADV,
        True,
        dict(
            aggregation="sequence",
            tis_cap=2.0,
            mask_low=0.5,
            mask_high=2.0,
            kl_beta=0.1,
            kl_estimator="k1",
        ),
        -0.12138408422470093,
        [
            [
                -0.20685206353664398,
                -0.13453605771064758,
                -0.12054373323917389,
                0.012500000186264515,
            ],
            [0.1276434361934662, 0.20901748538017273, 0.08742857724428177, 0.0],
        ],
        dict(
            clipped=0.0,
            kl=0.24999982118606567,
            ratio=7.0,
            iw=485165184.0,
            iw_truncated=1.0,
            mismatch_masked=1.0,
        ),
    ),
    "gspo_sequence_tis_sequence_k2": (
        SEQ_ADV,
        True,
        dict(
            loss_type="gspo",
            aggregation="sequence",
            clip_low=0.1,
            clip_high=0.1,
            tis_cap=1.5,
            tis_level="sequence",
            kl_beta=0.1,
            kl_estimator="k2",
        ),
        -0.6395124197006226,
        [
            [-0.24249999225139618, -0.2474999874830246, -0.24124999344348907, -0.24312499165534973],
            [0.11764343082904816, 0.11097676306962967, 0.10764342546463013, 0.0],
        ],
        dict(clipped=0.0, kl=0.17125001549720764, ratio=7.0, iw=1940660736.0, iw_truncated=4.0),
    ),
    "gspo_token_clipped": (
        SEQ_ADV,
        False,
        dict(loss_type="gspo", clip_low=0.1, clip_high=0.1),
        -0.5221014618873596,
        [
            [0.0, 0.0, 0.0, 0.0],
            [0.09834714978933334, 0.09834714978933334, 0.09834714978933334, 0.0],
        ],
        dict(clipped=4.0, kl=0.0, ratio=1940660736.0, iw=7.0, iw_truncated=0.0),
    ),
    "cispo_token_advantages_mask_high": (
        TOKEN_ADV,
        False,
        dict(loss_type="cispo", mask_high=1.8),
        -0.07823838293552399,
        [
            [-0.22285716235637665, 0.025852497667074203, -0.05848076939582825, 0.0],
            [0.09512294828891754, -0.154285728931427, 0.12571430206298828, 0.0],
        ],
        dict(clipped=4.0, kl=0.0, ratio=485165184.0, iw=7.0, mismatch_masked=1.0),
    ),
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_losses_keep_their_pre_registry_values(case: str) -> None:
    adv, kl, settings, loss, grad, sums = PINNED[case]
    s = LossSettings(**settings)
    inp, lp = _inputs(adv, kl, s.aggregation)
    out = compute_loss(inp, s)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), torch.tensor(loss), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp.grad, torch.tensor(grad), rtol=1e-6, atol=1e-7)
    assert set(out.sums) == {
        "tokens",
        "clipped",
        "kl",
        "ratio",
        "iw",
        "iw_truncated",
        "mismatch_masked",
    }
    assert out.sums["tokens"] == 7.0
    for key, value in sums.items():
        assert out.sums[key] == pytest.approx(value, rel=1e-6), key


def test_the_registry_holds_the_configs_names() -> None:
    names = set(LOSS_TYPES)  # trainer.grpo.loss's members
    assert set(LOSSES) == names == {"ppo", "gspo", "cispo"}
    for name in names:
        assert get_loss(name) is LOSSES[name] and LOSSES[name].__name__ == name


def test_an_unknown_loss_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown loss_type 'sapo' \(registered: cispo, gspo, ppo\)"
    ):
        LossSettings(loss_type="sapo")
    with pytest.raises(ValueError, match="already registered"):
        register("ppo")(LOSSES["ppo"])
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        LossSettings(aggregation="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normaliser must be > 0"):
        LossInput(*[torch.zeros(1, 1)] * 4, normaliser=0.0)


def test_a_new_loss_is_one_registered_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain REINFORCE term ``-w A log pi`` built from the shared parts."""
    monkeypatch.setattr("trainer.policy_losses.LOSSES", dict(LOSSES))

    @register("reinforce")
    def reinforce(inp: LossInput, s: LossSettings) -> LossOutput:
        imp = importance(inp, s)
        ratio = imp.log_ratio.exp()
        return finish(inp, s, imp, -imp.iw * imp.adv * imp.lp, ratio, torch.zeros_like(imp.m))

    inp, lp = _inputs(SEQ_ADV, False, "token")
    out = compute_loss(inp, LossSettings(loss_type="reinforce"))
    out.loss.backward()
    mask = torch.tensor(MASK).float()
    expected = -(torch.tensor(SEQ_ADV).unsqueeze(-1) * mask) / 7.0
    torch.testing.assert_close(lp.grad, expected)
    assert out.sums["clipped"] == 0.0


def test_settings_from_config_field_by_field() -> None:
    cfg = GrpoConfig(
        policy_loss="cispo",
        clip_low=0.3,
        clip_high=4.0,
        tis_cap=2.5,
        tis_level="sequence",
        mismatch_mask_low=0.4,
        mismatch_mask_high=3.0,
        mismatch_mask_level="sequence",
        kl_beta=0.02,
        kl_estimator="k1",
        loss_aggregation="sequence",
    )
    assert LossSettings.from_config(cfg) == LossSettings(
        loss_type="cispo",
        clip_low=0.3,
        clip_high=4.0,
        tis_cap=2.5,
        tis_level="sequence",
        mask_low=0.4,
        mask_high=3.0,
        mask_level="sequence",
        kl_beta=0.02,
        kl_estimator="k1",
        aggregation="sequence",
    )
    default = LossSettings.from_config(GrpoConfig())
    assert (default.loss_type, default.kl_beta, default.clip_range) == ("ppo", 0.001, (0.8, 1.2))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_constant_aggregation_is_the_token_sum_over_sequences_times_the_length(
    loss_type: str,
) -> None:
    """Dr. GRPO's normaliser (TRL's ``dr_grpo``): the step's token sum over its sequences x
    ``constant_length``, so the loss and every gradient are the ``token`` aggregation's
    times tokens / (sequences x length) -- here 7 / (2 x 16)."""
    knobs = dict(loss_type=loss_type, clip_low=0.2, clip_high=0.28, kl_beta=0.1)
    token = LossSettings(**knobs)  # type: ignore[arg-type]
    constant = LossSettings(**knobs, aggregation="constant", constant_length=16)  # type: ignore[arg-type]
    assert token.step_normaliser(7, 2) == 7.0 and constant.step_normaliser(7, 2) == 32.0
    assert LossSettings(aggregation="sequence").step_normaliser(7, 2) == 2.0
    outs, grads = [], []
    for s in (token, constant):
        inp, lp = _inputs(SEQ_ADV, True, "token")
        inp = dataclasses.replace(inp, normaliser=s.step_normaliser(7, 2))
        out = compute_loss(inp, s)
        out.loss.backward()
        outs.append(out)
        grads.append(lp.grad)
    scale = 7.0 / 32.0
    torch.testing.assert_close(outs[1].loss.detach(), outs[0].loss.detach() * scale)
    torch.testing.assert_close(grads[1], grads[0] * scale)
    assert grads[0].abs().sum() > 0
    assert outs[1].sums == outs[0].sums  # the logged sums do not depend on the normaliser


def test_constant_aggregation_needs_its_length_and_only_it_takes_one() -> None:
    with pytest.raises(ValueError, match="loss_aggregation constant needs constant_length"):
        GrpoConfig(loss_aggregation="constant")
    with pytest.raises(ValueError, match="constant_length is the normaliser of"):
        GrpoConfig(loss={"type": "ppo", "constant_length": 128})
    cfg = GrpoConfig(loss={"type": "gspo", "loss_aggregation": "constant", "constant_length": 128})
    s = LossSettings.from_config(cfg)
    assert (s.loss_type, s.aggregation, s.constant_length) == ("gspo", "constant", 128)
    with pytest.raises(ValueError, match="constant_length goes with aggregation constant"):
        LossSettings(aggregation="constant")


def test_trls_sequence_mask_is_ours_with_its_four_settings() -> None:
    """TRL's default correction with vLLM (``vllm_importance_sampling_mode="sequence_mask"``,
    ``clip_max`` 3, one iteration): the ratio is 1 and each sequence's policy term is weighed
    by w = exp(sum over its tokens of log pi_old - log pi_vLLM), or 0 where w > 3. Ours with
    ``tis_cap 3, tis_level sequence, mask_high 3, mask_level sequence`` gives that gradient,
    -A w grad(log pi) / normaliser, written out here; sequence 0 (w = 2.8) keeps its term,
    sequence 1 (w = 4.5) loses it on every token; a token-level mask would keep some."""
    lp_rows = [[-0.9, -1.6, -0.3, -2.2], [-0.5, -1.1, -3.0, -0.7]]
    w = [2.8, 4.5]  # the sequences' trainer/inference weights (row 1: 3 masked tokens)
    shift = [[0.4, 0.3, float(torch.tensor(2.8).log()) - 0.7, 0.0], [0.5, 0.5, 0.0, 0.0]]
    shift[1][2] = float(torch.tensor(4.5).log()) - 1.0
    inf = torch.tensor(lp_rows) - torch.tensor(shift)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    for row, want in enumerate(w):  # the weights as TRL computes them
        diff = (torch.tensor(lp_rows[row]) - inf[row]) * mask[row]
        assert float(diff.sum().exp()) == pytest.approx(want, rel=1e-5)
    trl = LossSettings(tis_cap=3.0, tis_level="sequence", mask_high=3.0, mask_level="sequence")
    lp = torch.tensor(lp_rows, requires_grad=True)
    out = compute_loss(LossInput(lp, inf, torch.tensor(SEQ_ADV), mask, 7.0), trl)
    out.loss.backward()
    kept = torch.tensor([[w[0]], [0.0]])  # sequence 1 is above 3: masked
    expected = -(torch.tensor(SEQ_ADV).unsqueeze(-1) * kept * mask) / 7.0
    torch.testing.assert_close(lp.grad, expected)
    assert out.sums["mismatch_masked"] == 3.0 and out.sums["clipped"] == 0.0

    token = dataclasses.replace(trl, mask_level="token")  # per token: none is above 3
    lp.grad = None
    compute_loss(LossInput(lp, inf, torch.tensor(SEQ_ADV), mask, 7.0), token).loss.backward()
    assert bool((lp.grad[1, :3] != 0).all())


def test_a_sequence_mask_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="mismatch_mask_level sequence needs mismatch_mask_low"):
        GrpoConfig(mismatch_mask_level="sequence")
    with pytest.raises(ValueError, match="unknown mask_level 'batch'"):
        LossSettings(mask_level="batch")  # type: ignore[arg-type]

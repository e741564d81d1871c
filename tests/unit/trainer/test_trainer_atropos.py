"""What the GRPO trainer does with the fields an Atropos environment sends (issue 28;
trainer/atropos_fields.py): each group goes through the API's own conversion
(``api.atropos_wire.prepare`` + ``api.atropos_convert.to_native``, as a native lease serves it), then through the
trainer's real code. Hand-computed values on the micro Qwen2, both packing paths."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from api import atropos_wire
from api.atropos_convert import to_native
from api.protocol import ScoredGroup
from tests.unit.trainer.test_trainer_core import _grpo_cfg, build_micro_model
from trainer.atropos_fields import refusal
from trainer.batch import EnvRows, flatten_groups
from trainer.config import GrpoConfig
from trainer.forward import prepare, stats_of
from trainer.grpo_step import StepContext, accumulate, token_advantages
from trainer.model import Reference, load_model
from trainer.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.unit
PROMPT = [3, 7, 11, 13]
COMPLETIONS = [[20, 21, 22], [30, 31, 32, 33], [40, 41, 42, 43, 44]]  # 3 + 4 + 5 tokens


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro"))


def item(**kw) -> dict:
    tokens = [PROMPT + c for c in COMPLETIONS]
    return {
        "tokens": tokens,
        "masks": [[-100] * len(PROMPT) + c for c in COMPLETIONS],
        "scores": [1.0, 0.0, 0.0],
        "inference_logprobs": [[0.0] * len(PROMPT) + [-3.0] * len(c) for c in COMPLETIONS],
        **kw,
    }


def leased(atropos_item: dict, gid: str = "g") -> ScoredGroup:
    """An Atropos group as the API stores it and a native lease serves it."""
    prepared = atropos_wire.prepare(msgspec.Raw(json.dumps(atropos_item).encode()), "zeros")
    return ScoredGroup.model_validate_json(to_native(prepared.payload, gid, "toy", 0))


def ctx_for(cfg: GrpoConfig, reference: bool = False) -> StepContext:
    lm = load_model(cfg)
    opt = build_optimizer(lm.model, cfg)
    ref = Reference(lm) if reference else None
    return StepContext(lm, ref, opt, build_scheduler(opt, cfg), cfg)


def trainer_logprobs(ctx: StepContext, group: ScoredGroup) -> list[list[float]]:
    """The micro model's own logprobs of each sequence's tokens, aligned to tokens."""
    items, _ = flatten_groups([group], 64)
    mb = prepare(items, 0, torch.device("cpu"), packed=False, min_shared=16)
    with torch.no_grad():
        lp = stats_of(ctx.loaded.model, mb, ctx.cfg.temperature, with_entropy=False).logprobs
    return [[0.0] + lp[r, : len(i.tokens) - 1].tolist() for r, i in enumerate(items)]


# -- refused at lease time, naming the key ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"overrides": [{"temperature": 0.5}, {}, {}]}, "overrides[0].temperature = 0.5"),
        ({"group_overrides": {"temperature": 1.3}}, "group_overrides.temperature = 1.3"),
        ({"generation_params": {"temperature": 0.2}}, "generation_params.temperature = 0.2"),
        ({"overrides": [{}, {"sft": True}, {}]}, "overrides[1].sft: SFT groups"),
        ({"group_overrides": {"my_weighting": 2}}, "group_overrides.my_weighting: the trainer"),
        ({"overrides": [{}, {}, {"lr_scale": 0.1}]}, "overrides[2].lr_scale"),
        ({"overrides": [{"set_advantage_to_zero": "yes"}, {}, {}]}, "must be true or false"),
        ({"images": ["img"]}, "images: multimodal"),
        ({"distill_token_ids": [[[1]] * 7, [[1]] * 8, [[1]] * 9]}, "distill_token_ids"),
        ({"advantages": [[1.0] * 3, [1.0] * 8, [1.0] * 9]}, "advantages[0] has 3 values, tok"),
        ({"ref_logprobs": [[0.0] * 7, [0.0] * 8, [0.0]]}, "ref_logprobs[2] has 1 values"),
    ],
)
def test_refused_with_the_key_named(fields: dict, fragment: str) -> None:
    reason = refusal(leased(item(**fields)), GrpoConfig(temperature=1.0))
    assert reason is not None and fragment in reason, reason


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"group_overrides": {"group_id": "x1", "policy_version": 3, "group_size": 3}},
        {"overrides": [{"set_advantage_to_zero": True}, {}, {"temperature": 0.7}]},
        {"generation_params": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 5}},
        {"messages": [[{"role": "user", "content": "hi"}]] * 3},
        {"group_overrides": {"my_weighting": 2}, "distill_logprobs": [[[-1.0]] * 7] * 3},
    ],
)
def test_applied_or_metadata_keys_pass(fields: dict) -> None:
    cfg = GrpoConfig(temperature=0.7, atropos_metadata_keys="my_weighting, distill_logprobs")
    assert refusal(leased(item(**fields)), cfg) is None


def test_a_misaligned_sequence_is_refused_naming_the_position() -> None:
    """A trained position must hold what was sampled there: its label the token itself, its
    inference logprob a logprob. ManagedServer's multi-turn shape passes: several trained
    runs, its 1.0 placeholder on the prompt and the env's reply between them."""
    cfg = GrpoConfig(temperature=1.0)
    base = item()
    turns = [m[:5] + [-100] + m[6:] for m in base["masks"]]  # answer / env / answer
    placeholders = [
        [1.0 if m == -100 else lp for m, lp in zip(mask, lps, strict=True)]
        for mask, lps in zip(turns, base["inference_logprobs"], strict=True)
    ]
    assert refusal(leased(item(masks=turns, inference_logprobs=placeholders)), cfg) is None
    relabelled = [list(m) for m in base["masks"]]
    relabelled[1][6] = 99  # a label that is another token
    reason = refusal(leased(item(masks=relabelled)), cfg)
    assert reason.startswith("masks[1][6] = 99 but tokens[1][6] = 32: a trained"), reason
    padded = [list(lps) for lps in placeholders]
    padded[2][-1] = 1.0  # ManagedServer pads a completion short of logprobs with 1.0
    reason = refusal(leased(item(masks=turns, inference_logprobs=padded)), cfg)
    assert reason.startswith("inference_logprobs[2][8] = 1 at a trained position"), reason
    missing = leased(item(masks=turns, inference_logprobs=None))  # recomputed: not checked
    assert refusal(missing, cfg) is None


def test_env_reference_mode_needs_ref_logprobs() -> None:
    cfg = GrpoConfig(kl_reference="env", kl_beta=0.1)
    assert "ref_logprobs: kl_reference is 'env'" in refusal(leased(item()), cfg)
    ok = item(ref_logprobs=[[0.0] * len(t) for t in item()["tokens"]])
    assert refusal(leased(ok), cfg) is None
    assert refusal(leased(item()), GrpoConfig(kl_reference="env", kl_beta=0.0)) is None


# -- the fields, item by item ----------------------------------------------------------------


def test_flatten_reads_the_atropos_fields() -> None:
    adv = [[0.0] * 4 + [float(k)] * len(c) for k, c in enumerate(COMPLETIONS)]
    g = leased(
        item(
            inference_logprobs=None,
            advantages=adv,
            overrides=[{}, {}, {"set_advantage_to_zero": True}],
        )
    )
    items, dropped = flatten_groups([g], 64)
    assert dropped == 0 and [i.logprobs_missing for i in items] == [True] * 3
    assert items[1].advantages == adv[1] and items[0].ref_logprobs is None
    assert [i.zero_advantage for i in items] == [False, False, True]
    assert items[0].logprobs == [0.0] * 7  # the placeholder, recomputed before training


def test_token_advantages_hand_values() -> None:
    none = torch.zeros(3, dtype=torch.bool)
    rows = EnvRows(
        advantages=torch.tensor([[0.0, 0.0, 5.0, 6.0], [0.0, 0.0, 0.0, 0.0], [9.0] * 4]),
        has_advantages=torch.tensor([True, False, False]),
        ref_logprobs=torch.zeros(3, 4),
        has_ref=none,
        logprobs_missing=none,
        zero_advantage=torch.tensor([False, False, True]),
    )
    adv = token_advantages(torch.tensor([0.5, -0.25, 2.0]), rows)
    torch.testing.assert_close(
        adv, torch.tensor([[0.0, 5.0, 6.0], [-0.25, -0.25, -0.25], [0.0, 0.0, 0.0]])
    )
    plain = dataclasses.replace(rows, has_advantages=none, zero_advantage=none)
    torch.testing.assert_close(
        token_advantages(torch.tensor([1.0, 2.0, 3.0]), plain), torch.tensor([1.0, 2.0, 3.0])
    )


@pytest.mark.parametrize("packing", ["prefix_tree", "padded"])
def test_missing_logprobs_are_recomputed_never_zeros(
    micro_model_dir: Path, tmp_path: Path, packing: str
) -> None:
    """Scores 1, 0, 0 (Dr. GRPO: A = 2/3, -1/3, -1/3) on 3, 4 and 5 completion tokens, no KL,
    no self-certainty. On-policy the ratio is exactly 1 and the loss is -sum(A n) / 12 =
    -(2 - 4/3 - 5/3) / 12 = 1/12. Trained on the placeholder zeros instead, the ratio would be
    pi / 1 (mean ratio far below 1)."""
    cfg = _grpo_cfg(
        micro_model_dir,
        tmp_path,
        packing=packing,
        kl_beta=0.0,
        self_certainty_alpha=0.0,
        scale_advantages=False,
    )
    ctx = ctx_for(cfg)
    stats = accumulate(ctx, flatten_groups([leased(item(inference_logprobs=None))], 64)[0])
    assert stats["loss"] == pytest.approx(1 / 12, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and stats["clip_fraction"] == 0
    assert stats["recomputed_logprob_sequences"] == 3
    assert stats["mismatch_kl"] == 0.0  # left out of the mismatch statistics
    ctx.optimizer.zero_grad()
    real = accumulate(ctx, flatten_groups([leased(item())], 64)[0])  # logprobs -3.0 as sent
    assert (
        real["ratio_mean"] != pytest.approx(1.0, abs=1e-3)
        and real["recomputed_logprob_sequences"] == 0
    )


@pytest.mark.parametrize("packing", ["prefix_tree", "padded"])
def test_env_advantages_replace_the_group_advantage(
    micro_model_dir: Path, tmp_path: Path, packing: str
) -> None:
    """On-policy (ratio 1), no KL: the loss is -(sum of the env's advantages over the completion
    tokens) / 12. Per-token advantages 1, 2, 3 on sequence 0's completion, -0.5 on each of
    sequence 1's, and sequence 2 carries 10s but ``set_advantage_to_zero``: -(6 - 2) / 12."""
    adv = [
        [0.0] * 4 + [1.0, 2.0, 3.0],
        [0.0] * 4 + [-0.5] * 4,
        [0.0] * 4 + [10.0] * 5,
    ]
    cfg = _grpo_cfg(
        micro_model_dir, tmp_path, packing=packing, kl_beta=0.0, self_certainty_alpha=0.0
    )
    ctx = ctx_for(cfg)
    overrides = [{}, {}, {"set_advantage_to_zero": True}]
    g = leased(item(inference_logprobs=None, advantages=adv, overrides=overrides))
    stats = accumulate(ctx, flatten_groups([g], 64)[0])
    assert stats["loss"] == pytest.approx(-(6.0 - 2.0) / 12, abs=1e-6)
    assert stats["env_advantage_sequences"] == 3


@pytest.mark.parametrize("packing", ["prefix_tree", "padded"])
def test_env_ref_logprobs_give_the_kl_without_a_reference_model(
    micro_model_dir: Path, tmp_path: Path, packing: str
) -> None:
    """``kl_reference: env``: no reference model. ref = pi - 0.2 on every token, all scores
    equal (A = 0): k1 per token is 0.2, k3 is exp(-0.2) + 0.2 - 1 = 0.018731; the loss is
    kl_beta times that (token mean)."""
    for estimator, value in (("k1", 0.2), ("k3", math.exp(-0.2) + 0.2 - 1)):
        cfg = _grpo_cfg(
            micro_model_dir,
            tmp_path,
            packing=packing,
            kl_beta=0.5,
            kl_reference="env",
            kl_estimator=estimator,
            self_certainty_alpha=0.0,
        )
        ctx = ctx_for(cfg)
        base = leased(item(scores=[1.0, 1.0, 1.0]))
        ref = [[x - 0.2 for x in row] for row in trainer_logprobs(ctx, base)]
        g = leased(item(scores=[1.0, 1.0, 1.0], ref_logprobs=ref))
        stats = accumulate(ctx, flatten_groups([g], 64)[0])
        assert stats["kl"] == pytest.approx(value, rel=1e-4), estimator
        assert stats["loss"] == pytest.approx(0.5 * value, rel=1e-4)
        assert stats["env_ref_sequences"] == 3


def test_env_ref_beside_the_reference_model(micro_model_dir: Path, tmp_path: Path) -> None:
    """``kl_reference: model``: a group without ref_logprobs gets the reference model's (KL 0
    before any step), one with them gets its own (k1 = 0.2): 12 tokens each, mean 0.1."""
    cfg = _grpo_cfg(
        micro_model_dir, tmp_path, kl_beta=0.5, kl_estimator="k1", self_certainty_alpha=0.0
    )
    ctx = ctx_for(cfg, reference=True)
    base = leased(item(scores=[1.0, 1.0, 1.0]), "a")
    ref = [[x - 0.2 for x in row] for row in trainer_logprobs(ctx, base)]
    with_ref = leased(item(scores=[1.0, 1.0, 1.0], ref_logprobs=ref), "b")
    stats = accumulate(ctx, flatten_groups([base, with_ref], 64)[0])
    assert stats["kl"] == pytest.approx((0.0 * 12 + 0.2 * 12) / 24, abs=1e-5)
    assert stats["env_ref_sequences"] == 3


# -- the lease-time refusal against a real API -----------------------------------------------


@pytest.fixture
def api_url(tmp_path: Path):
    """The batching API under uvicorn on a free port, in a thread of this process."""
    import threading

    import uvicorn

    from api.app import create_app
    from api.config import ApiConfig
    from settings.ports import free_port

    port = free_port()
    app = create_app(ApiConfig(db_path=tmp_path / "api.sqlite"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_refuse_marks_the_groups_rejected_at_the_api_and_trains_the_rest(
    api_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Three Atropos groups posted on ``/scored_data``, leased natively: the one with an
    unknown override key and the one sampled at another temperature are refused (logged with
    the key, ``rejected`` at the API, never served again), the third is what trains."""
    from api.client import ApiClient
    from trainer.atropos_fields import refuse

    posts = [
        item(group_overrides={"group_id": "ok"}),
        item(group_overrides={"group_id": "odd", "curriculum_bucket": 3}),
        item(group_overrides={"group_id": "hot"}, overrides=[{"temperature": 1.5}, {}, {}]),
    ]
    for p in posts:
        assert httpx.post(api_url + "/scored_data", json=p).json()["status"] == "received"
    api = ApiClient(api_url)
    lease = api.lease(max_tokens=10_000, max_sequences=9, lease_seconds=60)
    groups = list(lease.groups)
    with caplog.at_level(logging.ERROR, logger="trainer.atropos_fields"):
        kept = refuse(api, GrpoConfig(temperature=1.0), lease.batch_id, groups)
    assert [g.group_id for g in kept] == ["ok"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "group_overrides.curriculum_bucket" in logged and "overrides[0].temperature" in logged
    assert api.ack(lease.batch_id).groups_acked == 1
    status = api.status()
    assert status.rejected_groups == 2 and status.queued_groups == 0
    assert (
        api.lease(max_tokens=10_000, max_sequences=9, lease_seconds=60, allow_partial=True) is None
    )
    api.close()

"""bench/peers/same_batch.py on the tiny model: given the same two batches, our GRPO steps and
TRL's GRPOTrainer steps (trl==1.16.0, installed on first use as the peer bench does) compute
the same gradient directions and make the same AdamW updates.

Each batch is built, not sampled, so its reward spread is certain: each group holds the row's
gold answer (the env's reward pays it the most), another row's answer, the gold answer cut
short, and a non-answer (reward 0), with different lengths, so that the two loss normalisers
(ours: the trained tokens; TRL ``dr_grpo``: sequences x max_completion_length) really differ.
The preset is cpu-smol's (group-scaled advantages, prefix-tree packing), the tiny model in
place of SmolLM2, and two groups of four a step, computed in fp32 on every CPU: ``auto``
picks bf16 where the CPU has native bf16, and bf16's rounding alone moves the two sides'
gradient cosine to ~1 - 1e-5 (0.99998868 on an avx512_bf16 EPYC), so the test's 1e-6 would
pass or fail by CPU. Step 1 is checked in full (the gradients'
lengths as the normalisers predict them); at step 2 each side's gradient is taken on its own
weights and AdamW's replay of both sides' gradients (moments carried over, each side's
clipping) must predict the update since the start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peers.data import ShopR1Reward
from bench.peers.same_batch import one_run
from bench.peers.settings import resolve, run_all_argv, trl_args
from env_server.data.dataset import build_dataset
from env_server.prompts import format_target
from env_server.rollout import prompt_ids

pytestmark = pytest.mark.integration
GROUP, PROMPTS, STEPS = 4, 2, 2


def spread_batch(rows: list[dict], tok, env, reward: ShopR1Reward) -> list[dict]:
    """A group per row whose reward spread is certain (module docstring)."""
    batch = []
    for i, row in enumerate(rows[:-1]):
        gold = format_target(row["rationale"], json.loads(row["action"]))
        other = format_target("", json.loads(rows[i + 1]["action"]))
        texts = [gold, other, gold[: len(gold) // 2], "I would rather not say."]
        comps = [tok(t)["input_ids"][: env.max_tokens - 1] + [tok.eos_token_id] for t in texts]
        text_back = tok.batch_decode(comps, skip_special_tokens=True)
        scores = reward([""] * GROUP, text_back, [row["action"]] * GROUP)
        assert scores[0] == max(scores) > scores[3] == 0.0  # a certain spread
        ids = prompt_ids(row, tok, env.max_prompt_tokens, env.latest_only)
        batch.append({"row": row, "prompt": ids, "completions": comps, "scores": scores})
    lengths = {len(c) for p in batch for c in p["completions"]}
    assert len(lengths) > 2 and max(lengths) < env.max_tokens  # the normalisers differ
    return batch


def tiny_plan(tiny_model_dir: Path, tmp_path: Path, constant_length: int | None = None):
    """cpu-smol's settings on the tiny model, two groups of four a step."""
    argv = run_all_argv(
        "cpu-smol",
        tmp_path / "plan",
        None,
        1,
        1,
        str(tiny_model_dir),
        seed=0,
        constant_length=constant_length,
    )
    argv += ["--env.group-size", str(GROUP), "--trainer.grpo.batch-size", str(GROUP * PROMPTS)]
    argv += ["--trainer.grpo.precision", "fp32"]  # on every CPU (module docstring)
    return resolve(argv, 1)


def test_our_grpo_step_is_trls_on_the_same_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    plan = tiny_plan(tiny_model_dir, tmp_path)
    assert (plan.group_size, plan.prompts_per_step) == (GROUP, PROMPTS)
    assert plan.grpo.scale_advantages and plan.grpo.packing == "prefix_tree"
    env = plan.env
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = build_dataset(num_sessions=40, seed=0)["train"].to_list()[: STEPS * PROMPTS + 1]
    reward = ShopR1Reward(env.reward_config())
    batches = [
        spread_batch(rows[k * PROMPTS : (k + 1) * PROMPTS + 1], tok, env, reward)
        for k in range(STEPS)
    ]

    run = one_run(plan, str(tiny_model_dir), batches, tmp_path / "work", micro=GROUP)
    assert (run["precision"]["ours"], run["precision"]["trl"]) == ("torch.float32",) * 2
    steps = run["steps"]
    got = steps[0]
    grad, update = got["gradient"], got["update"]
    assert grad["tensors_nonzero_in_both"] == grad["tensors"]  # every tensor got a gradient
    assert grad["cosine"] > 1 - 1e-6 and grad["tensor_cosine_min"] > 1 - 1e-4, grad
    assert update["cosine"] > 1 - 1e-5, update
    adam = got["adamw_replayed"]  # what is left of the update's difference: Adam's eps
    assert adam["predicted"] == pytest.approx(update["cosine"], abs=1e-6)
    assert adam["same_length"] > 1 - 1e-9, adam
    assert got["trl"]["reward"] == pytest.approx(got["reward_mean"], rel=1e-6)
    assert got["lr"]["ours"] == got["lr"]["trl"] == plan.grpo.lr
    # The lengths differ only by the normalisers' ratio and the std's (N-1)/N, both constant.
    tokens = got["ours"]["tokens"]
    ratio = (GROUP * PROMPTS * env.max_tokens / tokens) * (GROUP / (GROUP - 1)) ** 0.5
    assert got["ours"]["grad_norm"] / got["trl"]["grad_norm"] == pytest.approx(ratio, rel=1e-3)
    # Later steps: each side's gradient on its own weights, the updates since the start, and
    # AdamW replayed on both sides' gradients (moments carried over, clipping as applied).
    for k, later in enumerate(steps[1:], start=2):
        grad, update, adam = later["gradient"], later["update"], later["adamw_replayed"]
        assert grad["cosine"] > 1 - 1e-5, (k, grad)
        assert adam["predicted"] == pytest.approx(update["cosine"], abs=1e-5), (k, adam, update)
        assert adam["same_length"] > 1 - 1e-6, (k, adam)

    # With TRL's normaliser (--trl-normaliser) ours runs again on the same batches; TRL's
    # side, whose settings did not change, is reused. The lengths then differ only by the
    # std's, and both sides clip alike.
    matched = tiny_plan(tiny_model_dir, tmp_path, constant_length=env.max_tokens)
    assert matched.trl_normaliser
    assert trl_args(matched, tmp_path, False, GROUP) == trl_args(plan, tmp_path, False, GROUP)
    trl_result = tmp_path / "work" / "trl" / "result.json"
    before = trl_result.stat().st_mtime_ns
    again = one_run(matched, str(tiny_model_dir), batches, tmp_path / "work", GROUP, reuse=True)
    assert trl_result.stat().st_mtime_ns == before  # TRL's side reused, not run again
    std = (GROUP / (GROUP - 1)) ** 0.5
    for k, step in enumerate(again["steps"], start=1):
        grad, adam = step["gradient"], step["adamw_replayed"]
        assert grad["cosine"] > 1 - 1e-5, (k, grad)
        ours_over_trl = step["ours"]["grad_norm"] / step["trl"]["grad_norm"]
        # step 1 on the same weights (measured 3e-6 off); later steps each on its own
        # weights, one update apart (measured 1e-4 off at step 2)
        assert ours_over_trl == pytest.approx(std, rel=1e-4 if k == 1 else 1e-3), k
        assert adam["predicted"] == pytest.approx(step["update"]["cosine"], abs=1e-5), k

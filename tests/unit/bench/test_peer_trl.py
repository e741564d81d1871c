"""bench/peers' setting-up of the two sides: TRL's side gets the env's prompts token for token
and the env's reward score for score; its GRPOConfig keywords are the preset's settings (and a
seed reaches both sides); TRL's requirements are checked against the venv; what ours runs
differently for a comparison says so (test_peer_report.py: reading the finished runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peers.data import ShopR1Reward, prompt_text, rows_in_env_order, trl_rows
from bench.peers.differences import (
    KEPT_CONSTANT_GROUPS,
    NOT_MATCHED,
    TRL_IMPORTANCE,
    TRL_NORMALISER,
    not_matched,
)
from bench.peers.settings import (
    TRL_GENERATION,
    matched,
    resolve,
    resolve_plan,
    run_all_argv,
    trl_args,
)
from bench.peers.trl_install import requirement_problems
from env_server.data.dataset import build_dataset
from env_server.inference import Completion, CompletionBatch
from env_server.prompts import format_target
from env_server.reward import RewardConfig
from env_server.rollout import build_group, prompt_ids
from env_server.service import cycle_rows

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return build_dataset(num_sessions=40, seed=0)["train"].to_list()


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _same_prompts(tok, rows: list[dict]) -> None:
    for budget in (928, 512):  # 512: the oldest pages dropped to fit
        for row in rows[:12]:
            text = prompt_text(row, tok, budget, False)
            ids = prompt_ids(row, tok, budget, False)
            assert list(tok(text=[text])["input_ids"][0]) == ids  # GRPOTrainer's own call
            assert len(ids) <= budget
    out = trl_rows(rows[:3], tok, 928, False)
    assert [r["gold"] for r in out] == [r["action"] for r in rows[:3]]
    assert [(r["session_id"], r["step"]) for r in out] == [
        (str(r["session_id"]), r["step"]) for r in rows[:3]
    ]


def test_trl_prompts_are_the_envs_token_for_token(tiny_model_dir: Path, rows: list[dict]) -> None:
    _same_prompts(_tokenizer(tiny_model_dir), rows)


@pytest.mark.smol
def test_trl_prompts_are_the_envs_on_smollm2(smol_model_dir: Path, rows: list[dict]) -> None:
    _same_prompts(_tokenizer(smol_model_dir), rows)


def test_reward_wrapper_scores_as_the_env(tiny_model_dir: Path, rows: list[dict]) -> None:
    tok = _tokenizer(tiny_model_dir)
    reward = RewardConfig.variant("no_dars")
    fn = ShopR1Reward(reward)
    for row in rows[:6]:
        gold = json.loads(row["action"])
        wrong = (
            {"type": "terminate"} if gold["type"] != "terminate" else {"type": "click", "name": "x"}
        )
        texts = [
            format_target(row["rationale"], gold),
            format_target("I looked around.", wrong),
            "not json at all",
        ]
        prompt = prompt_ids(row, tok, 928, False)
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        comps = [Completion(t, i, [-1.0] * len(i), "stop") for t, i in zip(texts, ids, strict=True)]
        group = build_group(row, CompletionBatch(prompt, comps, 0), tok, reward, 0)
        env_scores = [s["score"] for s in group["sequences"]]
        assert fn(["p"] * 3, texts, [row["action"]] * 3) == env_scores
        assert env_scores[0] > env_scores[2] == 0.0
    assert fn.__name__ == "shop_r1"


def test_rows_come_in_the_envs_order(tmp_path: Path) -> None:
    from env_server.data.dataset import load_or_build

    train = load_or_build(tmp_path / "data", 20, 0)["train"].to_list()
    n = len(train) + 7  # into the second epoch
    got = rows_in_env_order(tmp_path / "data", 20, 0, n)
    order = cycle_rows(train, 0)
    assert got == [next(order) for _ in range(n)]
    first = got[: len(train)]
    key = lambda r: (r["session_id"], r["step"])  # noqa: E731
    assert sorted(map(key, first)) == sorted(map(key, train))  # one epoch = each row once


@pytest.mark.parametrize(
    ("preset", "reward", "scale"), [("cpu-smol", "full", "group"), ("cpu-tiny", "no_dars", "none")]
)
def test_trl_config_holds_the_presets_settings(
    preset: str, reward: str, scale: str, tmp_path: Path
) -> None:
    argv = run_all_argv(preset, tmp_path / "ours", 6, 2, 9)
    assert "--eval-samples" in argv and argv[argv.index("--eval-samples") + 1] == "0"
    plan = resolve(argv, 2)
    g, env = plan.grpo, plan.env
    assert (plan.steps, g.save_every, g.keep_checkpoints) == (6, 2, 9)
    assert g.self_certainty_alpha == 0.0 and env.reward_variant == reward
    kw = trl_args(plan, tmp_path / "trl", bf16=True)
    assert kw["per_device_train_batch_size"] == g.batch_size == plan.batch_size
    assert kw["num_generations"] == env.group_size
    assert kw["per_device_train_batch_size"] // kw["num_generations"] == plan.prompts_per_step
    assert kw["learning_rate"] == g.lr and kw["beta"] == g.kl_beta
    assert kw["temperature"] == env.temperature == g.temperature
    assert kw["max_completion_length"] == env.max_tokens
    assert kw["loss_type"] == "dr_grpo" and kw["scale_rewards"] == scale
    assert kw["lr_scheduler_type"] == "constant" and kw["max_steps"] == 6
    assert kw["save_steps"] == 2 and kw["gradient_checkpointing"] is False
    assert kw["bf16"] is True and kw["num_iterations"] == kw["steps_per_generation"] == 1
    micro = trl_args(plan, tmp_path / "trl", bf16=True, micro_batch=env.group_size)
    assert micro["per_device_train_batch_size"] == env.group_size
    assert micro["gradient_accumulation_steps"] == micro["steps_per_generation"]
    assert micro["gradient_accumulation_steps"] * env.group_size == plan.batch_size
    with pytest.raises(ValueError, match="must divide"):
        trl_args(plan, tmp_path / "trl", bf16=True, micro_batch=plan.batch_size - 1)
    m = matched(plan)
    assert m["samples_per_step"] == plan.batch_size and m["reward"] == reward
    assert "self_certainty" in NOT_MATCHED and "loss_normaliser" in NOT_MATCHED


def test_trl_vllm_colocate_adds_only_its_generation_keywords(tmp_path: Path) -> None:
    plan = resolve(run_all_argv("cpu-tiny", tmp_path / "ours", 2, 1, 9), 1)
    plain = trl_args(plan, tmp_path / "trl", bf16=False)
    assert plain == trl_args(plan, tmp_path / "trl", bf16=False, generation="transformers")
    assert not any(k.startswith(("use_vllm", "vllm_")) for k in plain)  # TRL's generate path
    vllm = trl_args(plan, tmp_path / "trl", bf16=False, generation="vllm-colocate")
    added = {k: v for k, v in vllm.items() if k not in plain}
    assert {k: vllm[k] for k in plain} == plain  # every held-equal setting as it was
    assert added == {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_max_model_length": plan.env.max_prompt_tokens + plan.env.max_tokens,
    }
    with pytest.raises(ValueError, match="one of"):
        trl_args(plan, tmp_path / "trl", bf16=False, generation="vllm-server")
    assert not_matched() == NOT_MATCHED
    colocate = not_matched("vllm-colocate")
    assert colocate.keys() == NOT_MATCHED.keys()
    changed = {k for k in NOT_MATCHED if colocate[k] != NOT_MATCHED[k]}
    assert changed == {"importance_ratio", "generation"}
    assert "bf16" in colocate["generation"] and "colocate" in colocate["generation"]


def test_a_seed_reaches_both_sides(tmp_path: Path) -> None:
    default = resolve(run_all_argv("cpu-tiny", tmp_path / "ours", 2, 1, 9), 1)
    plan = resolve(run_all_argv("cpu-tiny", tmp_path / "ours", 2, 1, 9, seed=7), 1)
    assert default.grpo.seed != 7
    assert plan.run_all_argv[-2:] == ["--seed", "7"]  # ours: every service's seed
    assert plan.grpo.seed == 7 and plan.env.seed == 7  # the row order both sides walk
    assert trl_args(plan, tmp_path / "trl", bf16=False)["seed"] == 7  # TRL's training
    assert matched(plan)["seed"] == 7
    # --trl-seed: another run of TRL on the same rows (their order is the env's, seed 7's)
    other = trl_args(plan, tmp_path / "trl", bf16=False, seed=107)
    assert other["seed"] == 107 and other["shuffle_dataset"] is False
    assert other | {"seed": 7} == trl_args(plan, tmp_path / "trl", bf16=False)


def test_requirements_are_checked_against_the_venv() -> None:
    meta = "\n".join(
        [
            "Name: trl",
            "Requires-Dist: packaging>20.0",
            "Requires-Dist: numpy<1.0",
            "Requires-Dist: surely-not-installed-pkg>=1",
            'Requires-Dist: also-not-installed>=1; extra == "vllm"',
        ]
    )
    problems = requirement_problems(meta)
    assert len(problems) == 2
    assert any("numpy<1.0" in p and "installed" in p for p in problems)
    assert any("surely-not-installed-pkg" in p and "not installed" in p for p in problems)


def test_vllm_packed_linears_counts_the_layers_whose_weight_vllm_emptied() -> None:
    """What decides whether TRL's colocate sync goes through vLLM's layerwise reload: vLLM's
    CPU engine sets ``cpu_linear`` and empties ``weight`` of every linear it packs."""
    import torch

    from bench.peers.run_trl import vllm_packed_linears

    packed, plain, kept = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    packed.cpu_linear = torch.nn.functional.linear
    packed.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    kept.cpu_linear = torch.nn.functional.linear  # a fallback that keeps its weight
    assert vllm_packed_linears(torch.nn.Sequential(packed, plain, kept)) == 1
    assert vllm_packed_linears(torch.nn.Sequential(plain, kept)) == 0


def test_reproducible_runs_ours_on_policy_and_says_so(tmp_path: Path) -> None:
    default = resolve(run_all_argv("cpu-tiny", tmp_path / "ours", 2, 1, 9), 1)
    plan = resolve(run_all_argv("cpu-tiny", tmp_path / "ours", 2, 1, 9, reproducible=True), 1)
    assert not default.reproducible and "--reproducible" not in default.run_all_argv
    assert plan.reproducible and plan.run_all_argv[-1] == "--reproducible"
    for generation in TRL_GENERATION:
        stale, lockstep = not_matched(generation), not_matched(generation, reproducible=True)
        assert {k for k in stale if stale[k] != lockstep[k]} == {"importance_ratio"}
        assert "staleness" in stale["importance_ratio"]
        assert "on-policy" in lockstep["importance_ratio"]
        assert "staleness" not in lockstep["importance_ratio"]
        trl_half = stale["importance_ratio"].split("; TRL", 1)[1].lstrip(": ")
        assert lockstep["importance_ratio"].endswith(trl_half)


def test_trl_normaliser_runs_ours_with_dr_grpos_and_says_so(tmp_path: Path) -> None:
    """``--trl-normaliser``: ours sums its loss over the step's tokens / (sequences x
    max_tokens), TRL dr_grpo's normaliser (max_completion_length = max_tokens); TRL's side
    is unchanged, and the result's differences say the normaliser is matched."""
    kw = dict(preset="cpu-tiny", run_dir=tmp_path / "ours", steps=2, keep=9)
    default, plan = resolve_plan(1, **kw), resolve_plan(1, True, **kw)
    assert default.grpo.loss.loss_aggregation == "token" and not default.trl_normaliser
    loss = plan.grpo.loss
    assert (loss.loss_aggregation, loss.constant_length) == ("constant", plan.env.max_tokens)
    assert plan.trl_normaliser
    trl = trl_args(plan, tmp_path / "trl", bf16=False)
    assert trl == trl_args(default, tmp_path / "trl", bf16=False)
    assert (trl["loss_type"], trl["max_completion_length"]) == ("dr_grpo", loss.constant_length)
    for generation in TRL_GENERATION:
        ours, theirs = not_matched(generation), not_matched(generation, trl_normaliser=True)
        assert {k for k in ours if ours[k] != theirs[k]} == {"loss_normaliser"}
        assert theirs["loss_normaliser"] == TRL_NORMALISER
    assert "population std" in NOT_MATCHED["advantage_std"]


def test_trl_importance_runs_ours_with_trls_sequence_mask_and_says_so(tmp_path: Path) -> None:
    """``--trl-importance``: ours' loss takes TRL's default vLLM correction (TRL_IS_FLAGS);
    TRL's side is unchanged, and the result's differences say the ratio is matched, and
    whether ours samples on-policy; TRL without vLLM has no such correction to match."""
    kw = dict(preset="cpu-tiny", run_dir=tmp_path / "ours", steps=2, keep=9)
    default, plan = resolve_plan(1, **kw), resolve_plan(1, trl_importance=True, **kw)
    assert not default.trl_importance and plan.trl_importance
    loss = plan.grpo.loss
    assert (loss.tis_cap, loss.tis_level) == (3.0, "sequence")
    assert (loss.mismatch_mask_high, loss.mismatch_mask_level) == (3.0, "sequence")
    assert "--trainer-args=--save-every 1 --keep-checkpoints 9" in " ".join(plan.run_all_argv)
    assert trl_args(plan, tmp_path / "trl", bf16=False) == trl_args(
        default, tmp_path / "trl", bf16=False
    )
    for reproducible in (False, True):
        ours = not_matched("vllm-colocate", reproducible)
        theirs = not_matched("vllm-colocate", reproducible, trl_importance=True)
        assert {k for k in ours if ours[k] != theirs[k]} == {"importance_ratio"}
        assert theirs["importance_ratio"].startswith(TRL_IMPORTANCE)
        assert ("on-policy" in theirs["importance_ratio"]) == reproducible
    with pytest.raises(ValueError, match="TRL must generate with vLLM"):
        not_matched("transformers", trl_importance=True)


def test_kept_constant_groups_and_lockstep_match_the_prompts_and_say_so(tmp_path: Path) -> None:
    """``--keep-constant-groups``: the constant-groups line says they are matched; with
    ``--reproducible`` too (one batch in flight, nothing dropped: TRL's prompts in its order)
    the prompt-order difference is gone from the result."""
    kw = dict(preset="cpu-tiny", run_dir=tmp_path / "ours", steps=2, keep=9)
    assert not resolve_plan(1, **kw).keeps_constant_groups
    assert resolve_plan(1, keep_constant_groups=True, **kw).keeps_constant_groups
    base = not_matched("vllm-colocate")
    kept = not_matched("vllm-colocate", keep_constant_groups=True)
    assert {k for k in base if base.get(k) != kept.get(k)} == {"constant_groups"}
    assert kept["constant_groups"] == KEPT_CONSTANT_GROUPS
    both = not_matched("vllm-colocate", reproducible=True, keep_constant_groups=True)
    assert "prompt_order" not in both and "prompt_order" in kept


def test_ours_vllm_dtype_samples_in_it_and_evaluates_in_the_runs(tmp_path: Path) -> None:
    """``--ours-vllm-dtype bfloat16``: ours' run gives its vLLM server that dtype (the run's
    resolved ``vllm.dtype``), the evaluations' vLLM file keeps the run's own (none: the
    launcher's CPU default, fp32), the held-equal settings and TRL's side are unchanged, and
    the generation line says it."""
    import yaml

    from bench.peers.settings import write_vllm
    from launch.run_config import parse_args
    from launch.vllm_server import SERVER_DEFAULTS

    kw = dict(preset="cpu-tiny", run_dir=tmp_path / "ours", steps=2, keep=9)
    default, plan = resolve_plan(1, **kw), resolve_plan(1, True, vllm_dtype="bfloat16", **kw)
    assert default.sampling_dtype is None and default.eval_argv == default.run_all_argv
    assert plan.run_all_argv[-2:] == ["--vllm.dtype", "bfloat16"] and plan.trl_normaliser
    assert parse_args(plan.run_all_argv).vllm.dtype == "bfloat16"  # what ours samples in
    assert parse_args(default.run_all_argv).vllm.dtype is None  # SERVER_DEFAULTS: float32
    assert parse_args(plan.eval_argv).vllm.dtype is None
    assert SERVER_DEFAULTS[SERVER_DEFAULTS.index("--dtype") + 1] == "float32"
    evals = yaml.safe_load(write_vllm(plan, tmp_path / "eval").read_text())
    assert evals == yaml.safe_load(write_vllm(default, tmp_path / "eval0").read_text())
    assert "dtype" not in evals["vllm"]
    assert matched(plan) == matched(default)
    assert trl_args(plan, tmp_path / "trl", bf16=True) == trl_args(
        default, tmp_path / "trl", bf16=True
    )
    fp32, bf16 = (
        not_matched("vllm-colocate"),
        not_matched("vllm-colocate", sampling_dtype="bfloat16"),
    )
    assert {k for k in fp32 if fp32[k] != bf16[k]} == {"generation"}
    assert bf16["generation"].startswith("ours: vLLM (bfloat16 by --ours-vllm-dtype, eager,")

"""Every shipped recipe parses into every service's config; the tiny recipes match the cpu-tiny
preset and the trainer defaults; the ablation recipes score exactly like the paper's variants."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from api.config import ApiConfig
from api.config import parse_config as parse_api
from env_server.config import EnvConfig
from env_server.config import parse_config as parse_env
from env_server.reward import RewardConfig, score
from settings.cli import resolve
from settings.paths import REPO_ROOT
from launch.presets import PRESETS
from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args
from vllm_patching.serve import build

pytestmark = pytest.mark.unit

RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
TINY = REPO_ROOT / "recipes" / "tiny-qwen2" / "shop-r1"


def _all(recipe: Path) -> dict[str, object]:
    return {
        "api": resolve(ApiConfig, section="api", recipe=recipe).config,
        "env": resolve(EnvConfig, section="env", recipe=recipe).config,
        "sft": resolve(SftConfig, section="trainer.sft", recipe=recipe).config,
        "grpo": resolve(GrpoConfig, section="trainer.grpo", recipe=recipe).config,
    }


def test_recipes_are_shipped() -> None:
    names = {str(p.relative_to(REPO_ROOT / "recipes")) for p in RECIPES}
    assert {"tiny-qwen2/shop-r1/sft.yaml", "tiny-qwen2/shop-r1/grpo.yaml",
            "tiny-qwen2/shop-r1/grpo_binary.yaml", "tiny-qwen2/shop-r1/grpo_no_dars.yaml",
            "tiny-qwen2/shop-r1/grpo_no_format.yaml",
            "qwen2.5-0.5b-instruct/shop-r1/grpo.yaml",
            "qwen2.5-3b-instruct/shop-r1/grpo.yaml"} <= names  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_recipe_parses_into_every_service(recipe: Path) -> None:
    cfgs = _all(recipe)
    model = cfgs["sft"].model_name if "sft" in recipe.name else cfgs["grpo"].model_name
    assert cfgs["env"].tokenizer == model  # the shared 'model' key reaches every service
    assert cfgs["sft"].seed == cfgs["grpo"].seed == cfgs["env"].seed
    settings, vllm_args, _ = build(["--recipe", str(recipe), "--bridge-device", "cpu"])
    assert vllm_args[vllm_args.index("--model") + 1] == model
    if "grpo" in recipe.name:
        assert cfgs["env"].rewards is not None  # ablations are recipe entries
        assert settings.mode == cfgs["grpo"].weight_bridge_mode
        assert Path(cfgs["api"].db_path).parent == Path(cfgs["grpo"].save_path)
    # the command lines take the same recipe (flags on top)
    assert parse_api(["--recipe", str(recipe), "--port", "1234"]).port == 1234
    assert parse_env(["--recipe", str(recipe)]) == cfgs["env"]


def test_tiny_grpo_recipe_matches_the_cpu_tiny_preset() -> None:
    preset = PRESETS["cpu-tiny"]
    cfgs = _all(TINY / "grpo_no_dars.yaml")  # the preset trains with the no_dars ablation
    env, grpo = cfgs["env"], cfgs["grpo"]
    assert grpo.model_name == preset.model and env.tokenizer == preset.model
    assert env.group_size == preset.group_size and env.max_tokens == preset.max_tokens
    assert env.max_prompt_tokens == preset.max_prompt_tokens
    # prompt + completion fit the sequences the SFT recipe trains the model on
    sft = resolve(SftConfig, section="trainer.sft", recipe=TINY / "sft.yaml").config
    assert preset.max_prompt_tokens + preset.max_tokens <= sft.max_seq_len
    assert grpo.batch_size == preset.group_size * preset.batch_groups
    assert grpo.lr == preset.lr and grpo.device == preset.trainer_device
    # the preset's extra flags, applied over the recipe, change nothing: the same settings, and
    # its --reward-variant (which replaces the recipe's `rewards:`) scores exactly the same
    r = str(TINY / "grpo_no_dars.yaml")
    with_env_extra = parse_env(["--recipe", r, *preset.env_extra])
    assert with_env_extra.reward_variant == "no_dars" and with_env_extra.rewards is None
    same = {"reward_variant": "full", "rewards": env.rewards}
    assert with_env_extra.model_copy(update=same) == env
    for text, gold in _cases():
        assert (score(text, gold, with_env_extra.reward_config()).total
                == score(text, gold, env.reward_config()).total), (text, gold)  # fmt: skip
    # the other recipes differ from the preset's twin in the reward only
    for name in ("grpo.yaml", "grpo_binary.yaml", "grpo_no_format.yaml"):
        other = _all(TINY / name)
        assert other["grpo"].model_copy(update={"save_path": grpo.save_path}) == grpo, name
        same_reward = {"rewards": env.rewards, "metrics_path": env.metrics_path}
        assert other["env"].model_copy(update=same_reward) == env, name
    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    with_extra = config_from_args(GrpoConfig, parser.parse_args(["--recipe", r,
                                                                 *preset.trainer_extra]))  # fmt: skip
    assert with_extra == grpo, "preset trainer_extra differs from the recipe"


def test_tiny_sft_recipe_is_the_trainer_default() -> None:
    sft = _all(TINY / "sft.yaml")["sft"]
    # what the recipe sets on purpose: no TensorBoard (as launch/run_all.sh) and the dataset
    # size launch/run_all.sh builds; everything else is SftConfig's default.
    assert sft == SftConfig(tensorboard=False, num_sessions=3000)


def _cases() -> list[tuple[str, dict]]:
    """Completions x golds covering every reward branch (exact, near, wrong, invalid)."""
    golds = [
        {"type": "click", "name": "product_kuro_l370_stainless_steel_paring_knife"},
        {"type": "type_and_submit", "name": "search_input", "text": "noise cancelling headphones"},
        {"type": "terminate"},
    ]
    preds = [
        *golds,
        {"type": "click", "name": "product_kuro_l371_stainless_steel_paring_knife"},
        {"type": "click", "name": "buy_now"},
        {"type": "type_and_submit", "name": "search_box", "text": "noise cancelling headphones"},
        {"type": "type_and_submit", "name": "search_input", "text": "wireless headphones"},
    ]
    texts = [json.dumps({"rationale": "I look.", "action": p}) for p in preds] + ["not json"]
    return [(t, g) for t in texts for g in golds]


@pytest.mark.parametrize(
    ("recipe", "variant"),
    [("grpo.yaml", "full"), ("grpo_binary.yaml", "binary"), ("grpo_no_dars.yaml", "no_dars"),
     ("grpo_no_format.yaml", "no_format")],
)  # fmt: skip
def test_ablation_recipes_score_exactly_like_the_paper_variants(recipe: str, variant: str) -> None:
    spec = _all(TINY / recipe)["env"].reward_config()
    legacy = RewardConfig.variant(variant)
    for text, gold in _cases():
        assert score(text, gold, spec).total == score(text, gold, legacy).total, (text, gold)


def test_run_all_passes_the_recipe_to_the_services(tmp_path: Path) -> None:
    from launch.run_all import parse_args, recipe_args, trainer_argv

    recipe = TINY / "grpo.yaml"
    cfg = parse_args(["--recipe", str(recipe)])
    assert recipe_args(cfg) == ["--recipe", str(recipe)]
    argv = trainer_argv(cfg, PRESETS["cpu-tiny"], "m", "http://api", ["http://v"], "t",
                        tmp_path)  # fmt: skip
    assert argv[argv.index("--recipe") + 1] == str(recipe)
    assert recipe_args(parse_args([])) == []


SMOL = REPO_ROOT / "recipes" / "smollm2-135m-instruct" / "shop-r1"


def test_smol_recipes_match_the_cpu_smol_preset() -> None:
    from settings.paths import SMOL_MODEL_DIR, SMOL_SFT_MODEL_DIR

    preset = PRESETS["cpu-smol"]
    cfgs = _all(SMOL / "grpo.yaml")
    env, grpo = cfgs["env"], cfgs["grpo"]
    assert grpo.model_name == preset.model == str(SMOL_SFT_MODEL_DIR)
    assert env.group_size == preset.group_size and env.max_tokens == preset.max_tokens
    assert env.max_prompt_tokens == preset.max_prompt_tokens
    assert grpo.batch_size == preset.group_size * preset.batch_groups and grpo.lr == preset.lr
    assert grpo.device == preset.trainer_device and grpo.lora_r == 0
    # the preset's flags over the recipe change nothing
    r = str(SMOL / "grpo.yaml")
    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    flags = parser.parse_args(["--recipe", r, *preset.trainer_extra])
    assert config_from_args(GrpoConfig, flags) == grpo, (
        "preset trainer_extra differs from the recipe"
    )
    with_env_extra = parse_env(["--recipe", r, *preset.env_extra])
    same = {"reward_variant": "full", "rewards": env.rewards}
    assert with_env_extra.model_copy(update=same) == env
    for text, gold in _cases():
        assert (score(text, gold, with_env_extra.reward_config()).total
                == score(text, gold, env.reward_config()).total), (text, gold)  # fmt: skip
    # SFT: the preset's flags are the SFT recipe; prompt + completion fit its sequences
    sft = resolve(SftConfig, section="trainer.sft", recipe=SMOL / "sft.yaml").config
    assert sft.model_name == preset.base_model == str(SMOL_MODEL_DIR)
    assert sft.save_path == preset.model
    assert preset.max_prompt_tokens + preset.max_tokens <= sft.max_seq_len
    parser = argparse.ArgumentParser()
    build_parser(SftConfig, parser)
    flags = parser.parse_args(["--recipe", str(SMOL / "sft.yaml"), *preset.sft_extra])
    assert config_from_args(SftConfig, flags) == sft, "preset sft_extra differs from the recipe"

"""Every shipped recipe (presets included) parses into every service's config; the tiny and smol
recipes match their presets (recipes/presets/) and the trainer defaults; the ablation recipes
score exactly like the paper's variants."""

from __future__ import annotations

import json
from functools import reduce
from pathlib import Path

import pytest

from api.config import ApiConfig
from api.config import parse_config as parse_api
from env_server.config import EnvConfig
from env_server.config import parse_config as parse_env
from env_server.reward import RewardConfig, score
from launch.run_config import resolve_run
from settings.cli import resolve_section
from settings.layers import read_recipe
from settings.paths import PRESETS_DIR, REPO_ROOT
from trainer.config import GrpoConfig, SftConfig
from vllm_patching.serve import build

pytestmark = pytest.mark.unit

RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
TINY = REPO_ROOT / "recipes" / "tiny-qwen2" / "shop-r1"


def _all(recipe: Path) -> dict[str, object]:
    return {
        "api": resolve_section(ApiConfig, "api", [recipe], environ={}),
        "env": resolve_section(EnvConfig, "env", [recipe], environ={}),
        "sft": resolve_section(SftConfig, "trainer.sft", [recipe], environ={}),
        "grpo": resolve_section(GrpoConfig, "trainer.grpo", [recipe], environ={}),
    }


def test_recipes_are_shipped() -> None:
    names = {str(p.relative_to(REPO_ROOT / "recipes")) for p in RECIPES}
    assert {
        "tiny-qwen2/shop-r1/sft.yaml",
        "tiny-qwen2/shop-r1/grpo.yaml",
        "tiny-qwen2/shop-r1/grpo_binary.yaml",
        "tiny-qwen2/shop-r1/grpo_no_dars.yaml",
        "tiny-qwen2/shop-r1/grpo_no_format.yaml",
        "qwen2.5-0.5b-instruct/shop-r1/grpo.yaml",
        "qwen2.5-3b-instruct/shop-r1/grpo.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_recipe_parses_into_every_service(recipe: Path) -> None:
    cfgs = _all(recipe)
    assert cfgs["sft"].seed == cfgs["grpo"].seed == cfgs["env"].seed
    if "sft" not in recipe.name:  # the shared 'model' key reaches every service but the SFT
        model = cfgs["grpo"].model_name
        assert cfgs["env"].tokenizer == model
        settings, vllm_args, _ = build(["--recipe", str(recipe), "--bridge-device", "cpu"])
        assert vllm_args[vllm_args.index("--model") + 1] == model
    if "grpo" in recipe.name:
        assert cfgs["env"].rewards is not None  # ablations are recipe entries
        assert settings.mode == cfgs["grpo"].weight_bridge_mode
        assert Path(cfgs["api"].db_path).parent == Path(cfgs["grpo"].save_path)
    # the command lines take the same recipe (flags on top)
    assert parse_api(["--recipe", str(recipe), "--port", "1234"]).port == 1234
    assert parse_env(["--recipe", str(recipe)]) == cfgs["env"]


def _preset(name: str, cls: type, section: str) -> object:
    """What preset ``name`` alone gives a service (no recipe, no launcher decisions)."""
    return reduce(getattr, section.split("."), resolve_run(["--preset", name], environ={}))


def load_preset(name: str) -> object:
    """A preset's file as written (``recipe``), its ``model`` and its ``launch:`` section."""
    from types import SimpleNamespace

    recipe = read_recipe(PRESETS_DIR / f"{name}.yaml")
    launch = resolve_run(["--preset", name], environ={}).launch
    return SimpleNamespace(recipe=recipe, model=recipe["model"], launch=launch)


def _check_twin(name: str, twin: Path, differ: tuple[str, ...] = ()) -> dict[str, object]:
    """The preset's settings are its recipe twin's: the same model, the same env and GRPO
    values for every key the preset sets (``differ``: on purpose not), the same reward."""
    preset = load_preset(name)
    cfgs = _all(twin)
    env, grpo = _preset(name, EnvConfig, "env"), _preset(name, GrpoConfig, "trainer.grpo")
    assert cfgs["grpo"].model_name == preset.model == cfgs["env"].tokenizer
    for key in preset.recipe["env"]:
        if key != "reward_variant":  # the twin writes it as registry entries
            assert getattr(env, key) == getattr(cfgs["env"], key), key
    for key in preset.recipe["trainer"]["grpo"]:
        if key not in differ:
            assert getattr(grpo, key) == getattr(cfgs["grpo"], key), key
    assert preset.launch.trainer_device == cfgs["grpo"].device
    for text, gold in _cases():
        assert (
            score(text, gold, env.reward_config()).total
            == score(text, gold, cfgs["env"].reward_config()).total
        ), (text, gold)
    # prompt + completion fit the sequences the SFT recipe trains the model on
    return cfgs


def test_tiny_grpo_recipe_matches_the_cpu_tiny_preset() -> None:
    cfgs = _check_twin("cpu-tiny", TINY / "grpo_no_dars.yaml")  # the no_dars ablation
    env, grpo = cfgs["env"], cfgs["grpo"]
    sft = resolve_section(SftConfig, "trainer.sft", [TINY / "sft.yaml"], environ={})
    assert env.max_prompt_tokens + env.max_tokens <= sft.max_seq_len
    assert grpo.batch_size == env.group_size * 4
    # the other recipes differ from the preset's twin in the reward only
    for name in ("grpo.yaml", "grpo_binary.yaml", "grpo_no_format.yaml"):
        other = _all(TINY / name)
        assert other["grpo"].model_copy(update={"save_path": grpo.save_path}) == grpo, name
        same_reward = {"rewards": env.rewards, "metrics_path": env.metrics_path}
        assert other["env"].model_copy(update=same_reward) == env, name


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
    [
        ("grpo.yaml", "full"),
        ("grpo_binary.yaml", "binary"),
        ("grpo_no_dars.yaml", "no_dars"),
        ("grpo_no_format.yaml", "no_format"),
    ],
)
def test_ablation_recipes_score_exactly_like_the_paper_variants(recipe: str, variant: str) -> None:
    spec = _all(TINY / recipe)["env"].reward_config()
    legacy = RewardConfig.variant(variant)
    for text, gold in _cases():
        assert score(text, gold, spec).total == score(text, gold, legacy).total, (text, gold)


SMOL = REPO_ROOT / "recipes" / "smollm2-135m-instruct" / "shop-r1"


def test_smol_recipes_match_the_cpu_smol_preset() -> None:
    from settings.paths import SMOL_MODEL_DIR, SMOL_SFT_MODEL_DIR

    # precision: the preset says `auto` (trainer/precision.py picks bf16 where the CPU runs it
    # natively), the recipe twin asks for bf16 outright
    cfgs = _check_twin("cpu-smol", SMOL / "grpo.yaml", differ=("precision",))
    preset = load_preset("cpu-smol")
    env, grpo = cfgs["env"], cfgs["grpo"]
    assert grpo.model_name == preset.model == str(SMOL_SFT_MODEL_DIR)
    assert grpo.batch_size == env.group_size * 4 and grpo.lora_r == 0
    # SFT: the preset's SFT settings are the SFT recipe's; prompt + completion fit its sequences
    sft = resolve_section(SftConfig, "trainer.sft", [SMOL / "sft.yaml"], environ={})
    assert sft.model_name == preset.launch.base_model == str(SMOL_MODEL_DIR)
    assert sft.save_path == preset.model
    assert env.max_prompt_tokens + env.max_tokens <= sft.max_seq_len
    preset_sft = _preset("cpu-smol", SftConfig, "trainer.sft")
    for key in preset.recipe["trainer"]["sft"]:
        if key != "precision":
            assert getattr(preset_sft, key) == getattr(sft, key), key

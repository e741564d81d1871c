"""launch/run_config.py + settings/layers.py: one ``RunConfig`` per run. Every precedence rule
(defaults < file < environment < command line; shortcuts inside their layer; a preset under
``--recipe``; ``exclusive_fields``), the aliases, and every shipped recipe loading into the
same section values as each service's own resolution (settings/cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from api.config import ApiConfig
from api.config import parse_config as parse_api
from env_server.config import parse_config as parse_env
from launch.run_config import RunConfig, resolve_run
from settings.layers import SHORTCUTS, env_layer, expand, resolve
from settings.paths import REPO_ROOT
from settings.recipe import recipe_chain
from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args
from vllm_patching.serve import build, file_argv

pytestmark = pytest.mark.unit
RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
GRPO = REPO_ROOT / "recipes" / "tiny-qwen2" / "shop-r1" / "grpo.yaml"


def _file(path: Path) -> RunConfig:
    """defaults < the file alone (no preset)."""
    layers = [(str(p), expand(data, SHORTCUTS)) for p, data in recipe_chain(path)]
    return resolve(RunConfig, layers).config


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_recipe_loads_into_the_sections_each_service_parses(recipe: Path) -> None:
    """The launcher's RunConfig and each service started on its own (``--recipe``) read the
    same values from a file."""
    cfg = _file(recipe)
    assert parse_api(["--recipe", str(recipe)]) == cfg.api
    assert parse_env(["--recipe", str(recipe)]) == cfg.env
    for command, cls in (("sft", SftConfig), ("grpo", GrpoConfig)):
        parser = argparse.ArgumentParser()
        build_parser(cls, parser)
        got = config_from_args(cls, parser.parse_args(["--recipe", str(recipe)]))
        assert got == getattr(cfg.trainer, command), command
    assert file_argv(recipe)[:2] == ["--model", cfg.vllm.model]
    settings, _, _ = build(["--recipe", str(recipe), "--bridge-device", "cpu"])
    assert settings.mode == (cfg.vllm.weight_bridge_mode or "shared_vllm")


def test_precedence_defaults_file_environment_command_line(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {GRPO}\nenv: {{temperature: 0.9, group_size: 4}}\n"
        "trainer: {grpo: {lr: 3.0e-4, kl_beta: 0.2}}\n"
    )
    assert resolve_run([]).config.env.temperature == 0.7  # the preset cpu-tiny's
    assert resolve_run([]).config.trainer.grpo.training_steps == 120
    argv = ["--recipe", str(recipe)]
    cfg = resolve_run(argv, environ={}).config
    assert cfg.env.temperature == 0.9 and cfg.trainer.grpo.lr == 3e-4  # file > preset
    assert cfg.trainer.grpo.batch_size == 32  # the preset's where the recipe is silent
    environ = {"SHOP_R1_ENV__TEMPERATURE": "0.5", "SHOP_R1_TRAINER__GRPO__LR": "2e-4"}
    r = resolve_run(argv, environ=environ)
    assert r.config.env.temperature == 0.5 and r.config.trainer.grpo.lr == 2e-4  # env > file
    assert r.sources["env.temperature"] == "environment"
    assert r.sources["env.group_size"] == f"recipe {recipe}"
    r = resolve_run([*argv, "--env.temperature", "0.25"], environ=environ)
    assert r.config.env.temperature == 0.25 and r.sources["env.temperature"] == "flag"
    assert r.config.trainer.grpo.lr == 2e-4


def test_shortcuts_aliases_and_dotted_overrides() -> None:
    r = resolve_run(
        [
            "--training-steps",
            "7",
            "--keep-constant-groups",
            "--model",
            "/m",
            "--env-args=--temperature 0.5 --max-eval-samples 9",
            "--trainer-args=--lr 1e-5 --kl-coef 0.3 --seq-len 512",
            "--run-dir",
            "/tmp/run",
            "--resume",
        ]
    )
    cfg = r.config
    assert cfg.trainer.grpo.training_steps == 7 and not cfg.env.drop_constant_groups
    assert cfg.trainer.grpo.model_name == cfg.env.tokenizer == cfg.vllm.model == "/m"
    assert cfg.env.temperature == 0.5 and cfg.env.eval_samples == 9
    assert (cfg.trainer.grpo.lr, cfg.trainer.grpo.kl_beta, cfg.trainer.grpo.max_seq_len) == (
        1e-5,
        0.3,
        512,
    )
    assert cfg.launch.run_dir == Path("/tmp/run") and cfg.launch.resume
    assert not cfg.trainer.grpo.resume  # --resume is the launcher's
    # a section's own value in the same layer beats the shortcut
    both = resolve_run(["--training-steps", "7", "--trainer.grpo.training-steps", "9"])
    assert both.config.trainer.grpo.training_steps == 9


def test_a_layer_giving_the_reward_one_way_replaces_the_others(tmp_path: Path) -> None:
    cfg = resolve_run(["--recipe", str(GRPO)]).config  # recipe `rewards:` over preset no_dars
    assert cfg.env.rewards is not None and cfg.env.reward_variant == "full"
    cfg = resolve_run(["--recipe", str(GRPO), "--env.reward-variant", "binary"]).config
    assert cfg.env.reward_variant == "binary" and cfg.env.rewards is None


def test_declared_environment_names_and_trainer_level_keys(tmp_path: Path) -> None:
    values = env_layer(GrpoConfig, "trainer.grpo", {"GAIL_USE": "1", "SHOP_R1_API_TOKEN": "t"})
    assert values == {"gail": {"use": "1"}, "api_token": "t"}
    assert env_layer(ApiConfig, "api", {"SHOP_R1_API__PORT": "9"}) == {"port": "9"}
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  device: cuda\n  grpo: {device: cpu}\n")
    cfg = _file(recipe)
    assert cfg.trainer.sft.device == "cuda" and cfg.trainer.grpo.device == "cpu"


def test_each_file_of_a_base_chain_is_a_layer(tmp_path: Path) -> None:
    """A recipe's ``base:`` lies one layer under it, so the child's ``clip_eps`` beats the
    base's ``clip_low``/``clip_high``, its ``reward_variant`` replaces the base's ``rewards:``,
    its ``model`` fills what the base set itself, and "set by" names the file that set it."""
    child = tmp_path / "child.yaml"
    child.write_text(
        f"base: {GRPO}\nmodel: /m\nenv: {{reward_variant: binary}}\n"
        "trainer: {grpo: {clip_eps: 0.3}}\n"
    )
    r = resolve_run(["--recipe", str(child)], environ={})
    grpo = r.config.trainer.grpo
    assert (grpo.clip_low, grpo.clip_high, grpo.model_name) == (0.3, 0.3, "/m")
    assert r.config.env.reward_variant == "binary" and r.config.env.rewards is None
    assert r.sources["trainer.grpo.lr"] == f"recipe {GRPO}"
    assert r.sources["trainer.grpo.clip_low"] == f"recipe {child}"
    # a service started on its own reads the chain the same way
    assert parse_env(["--recipe", str(child)]) == r.config.env.model_copy(
        update={"tokenizer": "/m"}
    )


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="invalid RunConfig"):
        resolve_run(["--trainer.grpo.lr", "-1"])
    bad = tmp_path / "r.yaml"
    bad.write_text("env: {group_sise: 3}\n")
    with pytest.raises(SystemExit, match="group_sise"):
        resolve_run(["--recipe", str(bad)])


def test_one_file_flag_takes_a_run_file_or_a_flat_file(tmp_path: Path) -> None:
    """``--config`` and ``--recipe`` are one flag on every command; a service's file is a run
    file (its section) or a flat file of its own options, told apart by its keys."""
    from settings.cli import file_layers, is_run_file

    assert (
        resolve_run(["--config", str(GRPO)]).config == resolve_run(["--recipe", str(GRPO)]).config
    )
    assert parse_env(["--config", str(GRPO)]) == parse_env(["--recipe", str(GRPO)])
    assert is_run_file({"seed": 1}) and is_run_file({"modle": 1, "env": {}})
    assert not is_run_file({"seed": 1, "group_size": 8}) and not is_run_file({})
    flat = tmp_path / "env.yaml"
    flat.write_text("group-size: 3\nseed: 5\n")
    assert file_layers(flat, "env") == [(f"file {flat}", {"group_size": 3, "seed": 5})]
    later = tmp_path / "later.yaml"
    later.write_text("group_size: 6\n")
    both = parse_env(["--recipe", str(GRPO), "--config", str(flat), "--config", str(later)])
    assert (both.group_size, both.seed) == (6, 5)  # files in order, the run file's under them

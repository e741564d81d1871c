"""launch/run_config.py + settings/layers.py: one ``RunConfig`` per run. Every precedence rule
(defaults < file < environment < command line; a ``base:`` file under its child; a preset under
``--recipe``; shortcuts inside their layer; the env's reward keys replacing each other), the
aliases, and every shipped recipe loading into the same section values as each service's own
resolution (settings/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
from functools import reduce
from pathlib import Path

import pytest

from api.config import parse_config as parse_api
from env_server.config import EnvConfig
from env_server.config import parse_config as parse_env
from launch.run_config import RunConfig, resolve_run
from settings import paths
from settings.cli import resolve_section
from settings.layers import env_layer, expand, file_layers, resolve
from settings.paths import REPO_ROOT
from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args
from vllm_patching.serve import build, file_argv

pytestmark = pytest.mark.unit
RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
GRPO = REPO_ROOT / "recipes" / "tiny-qwen2" / "shop-r1" / "grpo.yaml"
PINNED = Path(__file__).parent.parent / "data" / "recipes_resolved.json"


def _file(path: Path) -> RunConfig:
    """defaults < the file alone (no preset, no environment)."""
    return resolve(RunConfig, file_layers(path))


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
    if cfg.vllm.model is None:  # an SFT recipe: nothing to serve
        return
    assert file_argv(recipe)[:2] == ["--model", cfg.vllm.model]
    settings, _, _ = build(["--recipe", str(recipe), "--bridge-device", "cpu"])
    assert settings.mode == (cfg.vllm.weight_bridge_mode or "shared_vllm")


def _pinned(recipe: Path) -> dict[str, object]:
    """A shipped recipe's run (non-default values), with the project's locations as names."""
    argv = ["--preset", recipe.stem] if recipe.parent.name == "presets" else ["--recipe", recipe]
    cfg = resolve_run([str(a) for a in argv], environ={})
    text = cfg.model_dump_json(exclude={"recipe"}, exclude_defaults=True)
    for name in ("RUNS_DIR", "ARTIFACTS", "REPO_ROOT"):
        text = text.replace(str(getattr(paths, name)), f"${{{name}}}")
    return json.loads(text)


def test_every_shipped_recipe_resolves_to_its_pinned_run_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When ``output_dir``, ``data:``, ``logging:`` and the top-level ``rewards:`` went, the
    recipes were rewritten to set the sections' fields: each resolves to the run it resolved
    to before (pinned: rewrite with ``SHOP_R1_PIN_RECIPES=1`` after a deliberate change)."""
    for name in ("SHOP_R1_API_TOKEN", "SHOP_R1_BRIDGE_TOKEN", "HF_TOKEN", "NUM_INFERENCE_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("GAIL_")]:
        monkeypatch.delenv(name)
    got = {str(r.relative_to(REPO_ROOT)): _pinned(r) for r in RECIPES}
    if os.environ.get("SHOP_R1_PIN_RECIPES"):
        PINNED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(PINNED.read_text())


def test_precedence_defaults_file_environment_command_line(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {GRPO}\nenv: {{temperature: 0.9, group_size: 4}}\n"
        "trainer: {grpo: {lr: 3.0e-4, kl_beta: 0.2}}\n"
    )
    assert RunConfig().env.temperature == 1.0  # the field default
    assert resolve_run([], environ={}).env.temperature == 0.7  # the preset cpu-tiny's
    assert resolve_run([], environ={}).trainer.grpo.training_steps == 120
    argv = ["--recipe", str(recipe)]
    cfg = resolve_run(argv, environ={})
    assert cfg.env.temperature == 0.9 and cfg.trainer.grpo.lr == 3e-4  # file > base > preset
    assert cfg.trainer.grpo.batch_size == 32 and cfg.env.concurrency == 4  # lower files' values
    environ = {"SHOP_R1_ENV__TEMPERATURE": "0.5", "SHOP_R1_TRAINER__GRPO__LR": "2e-4"}
    cfg = resolve_run(argv, environ=environ)
    assert cfg.env.temperature == 0.5 and cfg.trainer.grpo.lr == 2e-4  # environment > file
    assert cfg.env.group_size == 4  # the file's, the environment is silent
    cfg = resolve_run([*argv, "--env.temperature", "0.25"], environ=environ)
    assert cfg.env.temperature == 0.25 and cfg.trainer.grpo.lr == 2e-4  # command line > env
    # a service on its own: the same order, its flags without the section's prefix
    environ = {"SHOP_R1_ENV__TEMPERATURE": "0.5"}
    env = resolve_section(EnvConfig, "env", [recipe], {"seed": 9}, environ)
    assert (env.temperature, env.group_size, env.seed) == (0.5, 4, 9)


def test_shortcuts_aliases_and_dotted_overrides() -> None:
    cfg = resolve_run(
        [
            "--training-steps",
            "7",
            "--keep-constant-groups",
            "--sft-steps",
            "3",
            "--num-sessions",
            "200",
            "--model",
            "/m",
            "--seed",
            "4",
            "--env-args=--temperature 0.5 --max-eval-samples 9",
            "--trainer-args=--lr 1e-5 --kl-coef 0.3 --seq-len 512",
            "--run-dir",
            "/tmp/run",
            "--resume",
        ],
        environ={},
    )
    assert cfg.trainer.grpo.training_steps == 7 and not cfg.env.drop_constant_groups
    assert cfg.trainer.sft.training_steps == 3
    assert cfg.env.num_sessions == cfg.trainer.sft.num_sessions == 200
    assert cfg.trainer.grpo.model_name == cfg.env.tokenizer == cfg.vllm.model == "/m"
    assert cfg.trainer.sft.model_name != "/m"  # a run's model is what SFT writes
    assert cfg.env.seed == cfg.vllm.seed == cfg.trainer.sft.seed == cfg.trainer.grpo.seed == 4
    assert cfg.env.temperature == 0.5 and cfg.env.eval_samples == 9
    assert (cfg.trainer.grpo.lr, cfg.trainer.grpo.kl_beta, cfg.trainer.grpo.max_seq_len) == (
        1e-5,
        0.3,
        512,
    )
    assert cfg.launch.run_dir == Path("/tmp/run") and cfg.launch.resume
    assert not cfg.trainer.grpo.resume  # --resume is the launcher's
    # a section's own value in the same layer beats the shortcut; a higher layer's shortcut
    # beats a lower layer's section value
    both = resolve_run(["--training-steps", "7", "--trainer.grpo.training-steps", "9"])
    assert both.trainer.grpo.training_steps == 9
    env = {"SHOP_R1_TRAINER__GRPO__TRAINING_STEPS": "9"}
    assert resolve_run(["--training-steps", "7"], env).trainer.grpo.training_steps == 7


def test_a_layer_giving_the_reward_one_way_replaces_the_others(tmp_path: Path) -> None:
    cfg = resolve_run(["--recipe", str(GRPO)])  # recipe `rewards:` over preset no_dars
    assert cfg.env.rewards is not None and cfg.env.reward_variant == "full"
    cfg = resolve_run(["--recipe", str(GRPO), "--env.reward-variant", "binary"])
    assert cfg.env.reward_variant == "binary" and cfg.env.rewards is None
    both = tmp_path / "both.yaml"
    both.write_text("env: {reward_variant: binary, rewards: {components: {format: 1.0}}}\n")
    with pytest.raises(SystemExit, match="give the reward once"):
        resolve_run(["--recipe", str(both)])


def test_environment_names_and_trainer_level_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ = {"SHOP_R1_API__PORT": "9", "SHOP_R1_TRAINER__GRPO__LR": "1"}
    values = env_layer(RunConfig, "", environ)
    assert values == {"api": {"port": "9"}, "trainer": {"grpo": {"lr": "1"}}}
    assert env_layer(GrpoConfig, "trainer.grpo", environ) == {"trainer": {"grpo": {"lr": "1"}}}
    # the few names outside the convention are defaults read from their variable
    monkeypatch.setenv("GAIL_USE", "1")
    monkeypatch.setenv("SHOP_R1_API_TOKEN", "t")
    cfg = resolve_run([], environ={})
    assert cfg.trainer.grpo.gail.use and cfg.trainer.grpo.api_token == cfg.env.api_token == "t"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  device: cuda\n  grpo: {device: cpu, gail: {use: false}}\n")
    cfg = _file(recipe)
    assert cfg.trainer.sft.device == "cuda" and cfg.trainer.grpo.device == "cpu"
    assert not cfg.trainer.grpo.gail.use  # a file beats the variable (a default)


def test_each_file_of_a_base_chain_is_a_layer(tmp_path: Path) -> None:
    """A recipe's ``base:`` lies one layer under it: the child's ``clip_low`` beats the base's,
    its ``reward_variant`` replaces the base's ``rewards:``, its ``model`` fills what the base
    set itself."""
    child = tmp_path / "child.yaml"
    child.write_text(
        f"base: {GRPO}\nmodel: /m\nenv: {{reward_variant: binary}}\n"
        "trainer: {grpo: {clip_low: 0.3}}\n"
    )
    cfg = resolve_run(["--recipe", str(child)], environ={})
    grpo = cfg.trainer.grpo
    assert (grpo.loss.clip_low, grpo.loss.clip_high, grpo.model_name) == (0.3, 0.2, "/m")
    assert grpo.lr == 1e-4  # the base's
    assert cfg.env.reward_variant == "binary" and cfg.env.rewards is None
    # a service started on its own reads the chain the same way
    assert parse_env(["--recipe", str(child)]) == cfg.env.model_copy(update={"tokenizer": "/m"})


def test_errors_name_the_problem_the_file_and_the_key(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"trainer.grpo \(set by command line\)\n.*lr must"):
        resolve_run(["--trainer.grpo.lr", "-1"])
    with pytest.raises(SystemExit, match=r"env.temperature \(set by environment\)\n.*0"):
        resolve_run([], {"SHOP_R1_ENV__TEMPERATURE": "-1"})
    bad = tmp_path / "r.yaml"
    bad.write_text("env: {group_sise: 3}\n")
    with pytest.raises(SystemExit, match=rf"env.group_sise \(set by file {bad}\)"):
        resolve_run(["--recipe", str(bad)])
    for dropped in ("output_dir: /x", "data: {dir: /x}", "rewards: {}", "logging: {}"):
        bad.write_text(dropped + "\n")  # dropped shortcuts: an error, never ignored
        with pytest.raises(SystemExit, match=f"{bad}: unknown top-level key"):
            parse_env(["--recipe", str(bad)])
    bad.write_text("trainer: {grpo: {clip_eps: 0.3}}\n")  # dropped: clip_low and clip_high
    with pytest.raises(SystemExit, match="trainer.grpo.clip_eps"):
        resolve_run(["--recipe", str(bad)])


def test_one_file_flag_takes_run_files_in_order(tmp_path: Path) -> None:
    """``--config`` and ``--recipe`` are one flag on every command; a service's files are run
    files (a flat file of its own options is an error naming its first key)."""
    assert resolve_run(["--config", str(GRPO)]) == resolve_run(["--recipe", str(GRPO)])
    assert parse_env(["--config", str(GRPO)]) == parse_env(["--recipe", str(GRPO)])
    flat = tmp_path / "env.yaml"
    flat.write_text("group_size: 3\n")
    with pytest.raises(SystemExit, match=f"{flat}: unknown top-level key 'group_size'"):
        parse_env(["--config", str(flat)])
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    one.write_text("env: {group_size: 3, seed: 5}\n")
    two.write_text("env: {group_size: 6}\n")
    both = parse_env(["--recipe", str(GRPO), "--config", str(one), "--config", str(two)])
    assert (both.group_size, both.seed, both.max_tokens) == (6, 5, 96)  # in order
    assert expand({"trainer": {"lr": 1, "sft": {"lr": 2}}})["trainer"] == {
        "sft": {"lr": 2},
        "grpo": {"lr": 1},
    }


def test_a_run_files_top_level_keys_are_the_run_configs_fields() -> None:
    """``settings.layers.RUN_KEYS`` (what a service checks a file's top level against, without
    importing every section) is ``RunConfig``'s fields and ``base``; every shortcut a
    section declares is one of them, and fills a field its section has."""
    from settings.layers import RUN_KEYS, rules

    assert {*RunConfig.model_fields, "base"} == RUN_KEYS
    fills = rules(RunConfig).fills
    assert {key for key, _, _ in fills} == {
        "model",
        "seed",
        "weight_bridge_mode",
        "single_copy",
        "training_steps",
        "sft_steps",
        "num_sessions",
        "episode",
        "keep_constant_groups",
    }
    for key, path, _ in fills:
        section = reduce(getattr, path[:-1], RunConfig())
        assert key in RunConfig.model_fields and path[-1] in type(section).model_fields, path

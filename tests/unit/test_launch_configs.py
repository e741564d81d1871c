"""What launch/run_all.sh hands each service (issue #19, item 4): presets are recipes, and
every service's config is resolved once, lowest first: field defaults < preset < launcher
defaults < ``--recipe`` < launcher settings and flags < ``--env-args``/``--trainer-args``.
The files written to ``<run>/config/`` are parsed here by the services' own parsers."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from api.config import parse_config as parse_api
from env_server.config import parse_config as parse_env
from env_server.reward import RewardConfig, score
from launch.configs import (
    run_model,
    service_configs,
    sft_config,
    write_service_config,
    write_vllm_config,
)
from launch.presets import load_preset
from launch.run_all_config import layers, parse_args
from settings.paths import REPO_ROOT
from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args
from vllm_patching.serve import build

pytestmark = pytest.mark.unit
GRPO = REPO_ROOT / "recipes" / "tiny-qwen2" / "shop-r1" / "grpo.yaml"
GOLD = {"type": "click", "name": "product_kuro_l370_stainless_steel_paring_knife"}
HIT = '{"rationale": "r", "action": {"type": "click", "name": "product_kuro_l370_stainless_steel_paring_knife"}}'


def _resolve(argv: list[str], run_dir: Path) -> dict:
    """What launch/run_all.sh ``argv`` hands the API, the env and the GRPO trainer."""
    cfg = parse_args(argv)
    lay = layers(cfg, load_preset(cfg.preset))
    urls = ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    return service_configs(
        lay,
        run_model(lay, cfg.model),
        "http://127.0.0.1:1",
        urls,
        run_dir / "trainer",
        run_dir,
        env_args=cfg.env_args,
        trainer_args=cfg.trainer_args,
    )


def _trainer(command: str, argv: list[str]) -> object:
    """The config ``python -m trainer <command> argv`` runs with (its own parser)."""
    parser = argparse.ArgumentParser()
    cls = SftConfig if command == "sft" else GrpoConfig
    build_parser(cls, parser)
    return config_from_args(cls, parser.parse_args(argv))


def test_the_recipe_beats_the_preset_reward(tmp_path: Path) -> None:
    """`run_all.sh --recipe .../grpo.yaml` trains on the recipe's full reward (DARS 1000), not
    on the cpu-tiny preset's `no_dars` ablation (it used to: the preset's flag won)."""
    assert load_preset("cpu-tiny").recipe["env"]["reward_variant"] == "no_dars"
    env = _resolve(["--recipe", str(GRPO)], tmp_path)["env"]
    assert env.config.rewards is not None and env.config.reward_variant == "full"
    assert (
        env.sources["rewards.components"].startswith("recipe ")
        and "reward_variant" not in env.sources
    )
    full, no_dars = RewardConfig.variant("full"), RewardConfig.variant("no_dars")
    got = score(HIT, GOLD, env.config.reward_config()).total
    assert got == score(HIT, GOLD, full).total != score(HIT, GOLD, no_dars).total
    # without the recipe, the preset's ablation
    env = _resolve([], tmp_path)["env"]
    assert env.config.reward_variant == "no_dars" and env.sources["reward_variant"].startswith(
        "preset cpu-tiny"
    )


def test_flags_beat_the_recipe_and_the_recipe_beats_the_preset(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {GRPO}\nenv:\n  temperature: 0.9\ntrainer:\n  grpo:\n"
        "    training_steps: 33\n    lr: 3.0e-4\n"
    )
    confs = _resolve(["--recipe", str(recipe)], tmp_path)
    env, grpo = confs["env"].config, confs["trainer_grpo"].config
    assert env.temperature == 0.9  # recipe 0.9 > preset 0.7
    assert grpo.training_steps == 33  # the recipe's: the launcher's default 120 is under it
    assert grpo.lr == 3e-4 and grpo.kl_beta == 0.05  # the recipe's; the preset's where unset
    assert _resolve([], tmp_path)["trainer_grpo"].config.training_steps == 120  # the default
    confs = _resolve(
        [
            "--recipe",
            str(recipe),
            "--training-steps",
            "7",
            "--keep-constant-groups",
            "--env-args=--temperature 0.5 --reward-variant binary",
            "--trainer-args=--lr 1e-5",
        ],
        tmp_path,
    )
    env, grpo = confs["env"].config, confs["trainer_grpo"].config
    assert grpo.training_steps == 7 and grpo.lr == 1e-5  # flags > recipe
    assert env.temperature == 0.5 and not env.drop_constant_groups
    assert env.reward_variant == "binary" and env.rewards is None  # a flag replaces `rewards:`
    # what the launcher decides for the run beats the recipe's output_dir and model
    assert grpo.save_path == str(tmp_path / "trainer") and env.metrics_path == tmp_path / (
        "env_metrics.jsonl"
    )
    assert grpo.inference_urls() == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert env.inference_urls() == grpo.inference_urls() and env.api_url == grpo.api_url


def test_the_resolved_files_are_what_the_services_parse(tmp_path: Path) -> None:
    confs = _resolve(
        ["--recipe", str(GRPO), "--training-steps", "5", "--trainer-args=--kl-coef 0.02"], tmp_path
    )
    files = {name: write_service_config(tmp_path, name, r) for name, r in confs.items()}
    assert sorted(p.name for p in (tmp_path / "config").iterdir()) == [
        "api.yaml",
        "env.yaml",
        "trainer_grpo.yaml",
    ]
    assert parse_api(["--config", str(files["api"])]) == confs["api"].config
    assert parse_env(["--config", str(files["env"])]) == confs["env"].config
    grpo = _trainer("grpo", ["--config", str(files["trainer_grpo"])])
    assert grpo == confs["trainer_grpo"].config and grpo.training_steps == 5
    assert grpo.kl_beta == 0.02
    text = files["trainer_grpo"].read_text() + files["env"].read_text()
    assert "api_token" not in yaml.safe_load(files["env"].read_text())
    assert "bridge_token" not in text  # secrets travel by env var / flag, never in a file
    # the SFT cold start's file
    cfg = parse_args(["--recipe", str(GRPO), "--sft-steps", "3", "--num-sessions", "200"])
    lay = layers(cfg, load_preset("cpu-tiny"))
    sft = sft_config(lay, tmp_path / "sft", resume=False)
    path = write_service_config(tmp_path, "trainer_sft", sft)
    parsed = _trainer("sft", ["--config", str(path)])
    assert parsed == sft.config and parsed.training_steps == 3 and parsed.num_sessions == 200
    assert parsed.precision == "fp32" and parsed.eval_generate == 0 and parsed.overwrite
    # vLLM: the preset's and the recipe's options, read in place by the server's own parser
    vllm = write_vllm_config(lay, tmp_path)
    values = yaml.safe_load(vllm.read_text())
    assert values["dtype"] == "float32" and values["enforce_eager"] is True  # the recipe's
    assert "model" not in values and "weight_bridge_mode" not in values  # the launcher's
    settings, vllm_args, _ = build(
        [
            "--model",
            "m",
            "--dtype",
            "bfloat16",
            "--config",
            str(vllm),
            "--bridge-device",
            "cpu",
            "--max-model-len",
            "1024",
        ]
    )
    assert _last(vllm_args, "--dtype") == "float32"  # a flag before the file loses to it...
    assert _last(vllm_args, "--max-model-len") == "1024"  # ...one after it wins
    assert settings.mode == "shared_vllm"


def _last(argv: list[str], flag: str) -> str:
    """The value vLLM's parser keeps: the last one given."""
    return argv[len(argv) - argv[::-1].index(flag)]


def test_cpu_smol_trains_at_auto_precision(tmp_path: Path) -> None:
    cfg = parse_args(["--preset", "cpu-smol"])
    lay = layers(cfg, load_preset("cpu-smol"))
    assert sft_config(lay, tmp_path, resume=True).config.precision == "auto"
    confs = _resolve(["--preset", "cpu-smol"], tmp_path)
    assert confs["trainer_grpo"].config.precision == "auto"
    assert confs["trainer_grpo"].config.batch_size == 8 and confs["env"].config.group_size == 4


def test_a_preset_sets_its_own_steps_and_evaluation_size(tmp_path: Path) -> None:
    """cpu-smol names 30 GRPO steps and 256 evaluation rows: they are the defaults of its run
    (run_all's 120 applies only to a preset that names none), and a flag still wins."""
    smol = _resolve(["--preset", "cpu-smol"], tmp_path / "a")["trainer_grpo"].config
    tiny = _resolve([], tmp_path / "b")["trainer_grpo"].config
    given = _resolve(["--preset", "cpu-smol", "--training-steps", "7"], tmp_path / "c")
    assert (smol.training_steps, tiny.training_steps) == (30, 120)
    assert given["trainer_grpo"].config.training_steps == 7
    assert load_preset("cpu-smol").launch.eval_samples == 256
    assert load_preset("cpu-tiny").launch.eval_samples == 512
    assert parse_args(["--preset", "cpu-smol"]).eval_samples is None  # -> the preset's

"""settings/cli.py and settings/recipe.py: flags from pydantic fields, run files, environment
variables, precedence, errors, ``--print-config``; vllm_patching/serve.py's ``--config``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from api.config import ApiConfig
from env_server.config import EnvConfig
from env_server.config import parse_config as parse_env
from settings import cli
from settings.layers import recipe_chain
from trainer.config import GrpoConfig
from vllm_patching.serve import expand_files

pytestmark = pytest.mark.unit


def _grpo(argv: list[str], environ: dict[str, str] | None = None) -> GrpoConfig:
    parser = argparse.ArgumentParser()
    cli.add_config_flags(parser, GrpoConfig)
    return cli.resolve_args(GrpoConfig, parser.parse_args(argv), "trainer.grpo", environ or {})


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_flags_follow_field_types(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _grpo(
        [
            "--no-tensorboard",
            "--tis-cap",
            "null",
            "--kl-coef",
            "0.3",
            "--gail.use",
            "--gail.weight",
            "0.25",
            "--lr",
            "0.5",
            "--policy-loss",
            "gspo",
            "--resume",
        ]
    )
    assert (
        not cfg.tensorboard
        and cfg.loss.tis_cap is None
        and cfg.lr == 0.5
        and cfg.loss.type == "gspo"
    )
    assert cfg.gail.use and cfg.gail.weight == 0.25 and cfg.resume == "latest"
    assert cfg.kl_beta == 0.3  # an Atropos alias
    with pytest.raises(SystemExit, match="policy_loss"):  # a Literal: pydantic names the field
        _grpo(["--policy-loss", "medium"])
    with pytest.raises(SystemExit):
        _grpo(["--lr"])  # argparse: expected one argument
    assert "expected one argument" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    cli.add_config_flags(parser, GrpoConfig)
    text = " ".join(parser.format_help().split())
    assert "--gail.weight" in text and "{ppo,gspo,cispo}" in text
    assert "--lr float Learning rate" in text or "--lr float Peak" in text  # its docstring
    with pytest.raises(SystemExit, match=r"env.rewards \(set by command line\)"):
        parser = argparse.ArgumentParser()
        cli.add_config_flags(parser, EnvConfig)
        cli.resolve_args(EnvConfig, parser.parse_args(["--rewards", "x"]), "env")


def test_precedence_defaults_file_environment_flags(tmp_path: Path) -> None:
    recipe = _write(
        tmp_path / "r.yaml",
        """
model: from-recipe-shared
seed: 3
trainer:
  lr: 0.1
  grpo:
    policy_loss: gspo
    tis_cap: 2.0
    gail: {use: true, weight: 0.9}
""",
    )
    config = _write(tmp_path / "c.yaml", "trainer: {grpo: {lr: 0.2}}\n")
    environ = {"SHOP_R1_TRAINER__GRPO__GAIL__WEIGHT": "0.7", "SHOP_R1_TRAINER__GRPO__SEED": "5"}
    cfg = _grpo(["--recipe", str(recipe), "--config", str(config), "--seed", "7"], environ)
    assert cfg.model_name == "from-recipe-shared"  # shared key 'model' -> model_name
    assert cfg.loss.type == "gspo" and cfg.loss.tis_cap == 2.0  # the recipe's
    assert cfg.lr == 0.2  # files apply in order: the later one wins
    assert cfg.gail.weight == 0.7  # the environment beats the files
    assert cfg.gail.use  # nested: the recipe's other keys survive the environment layer
    assert cfg.seed == 7  # flags beat everything
    again = _grpo(["--recipe", str(recipe), "--gail.weight", "0.1"], environ)
    assert again.gail.weight == 0.1 and again.gail.use and again.seed == 5
    assert _grpo([]) == GrpoConfig()


def test_print_config_masks_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOP_R1_API_TOKEN", "s3cret")
    with pytest.raises(SystemExit) as e:
        cli.parse(ApiConfig, ["--print-config", "--port", "4"], prog="api", section="api")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "token: '***'" in out and "port: 4" in out
    assert "db_path:" in out  # only secrets are masked


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modle: x\ntrainer: {}\n", "unknown top-level key 'modle'"),
        ("trainer:\n  grpo:\n    lr_typo: 1\n", "trainer.grpo.lr_typo (set by file"),
        ("trainer:\n  grpo:\n    gail: {usee: true}\n", "gail.usee (set by file"),
        ("trainer: [1, 2]\n", "trainer (set by file"),
        ("- a\n- b\n", "must hold a mapping"),
        ("trainer: {lr: [unclosed\n", "not valid YAML"),
        ("model: ${SHOP_R1_TEST_UNSET_VAR}\n", "model uses ${SHOP_R1_TEST_UNSET_VAR}"),
        ("trainer:\n  lr: -1\n", "trainer.grpo (set by file"),
        ("base: [1]\n", "'base' must be the path of another recipe"),
    ],
)
def test_recipe_errors_name_the_key_and_the_file(tmp_path: Path, text: str, message: str) -> None:
    recipe = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as e:
        _grpo(["--recipe", str(recipe)])
    assert message in str(e.value) and str(recipe) in str(e.value)


def test_recipe_base_variables_and_loops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOP_R1_TEST_DIR", "/data/x")
    _write(
        tmp_path / "base.yaml",
        "model: ${SHOP_R1_TEST_DIR}/m\nseed: 1\n"
        "trainer: {lr: 0.1, grpo: {policy_loss: gspo}}\nenv: {rewards: {components: {format: 0.5}}}\n",
    )
    child = _write(
        tmp_path / "child.yaml",
        "base: base.yaml\nseed: 2\n"
        "trainer: {grpo: {tis-cap: 1.5}}\nenv: {rewards: {components: {type: 0.3}}}\n"
        "name: ${SHOP_R1_TEST_UNSET_VAR:-fallback}\n",
    )
    (base, lower), (path, upper) = recipe_chain(child)  # one layer per file, base first
    assert (base, path) == (tmp_path / "base.yaml", child) and "base" not in upper
    assert lower["model"] == "/data/x/m" and (lower["seed"], upper["seed"]) == (1, 2)
    assert upper["trainer"] == {"grpo": {"tis_cap": 1.5}} and upper["name"] == "fallback"
    cfg = _grpo(["--recipe", str(child)])
    assert (cfg.model_name, cfg.seed, cfg.lr, cfg.loss.type, cfg.loss.tis_cap) == (
        "/data/x/m",
        2,
        0.1,
        "gspo",
        1.5,
    )
    rewards = parse_env(["--recipe", str(child)]).rewards
    assert rewards is not None and set(rewards.components) == {"type"}  # replaced whole
    loop = _write(tmp_path / "loop.yaml", "base: loop.yaml\n")
    with pytest.raises(SystemExit, match="loops back"):
        recipe_chain(loop)


def test_vllm_file_args_stand_where_the_file_is(tmp_path: Path) -> None:
    recipe = _write(
        tmp_path / "r.yaml",
        """
model: /models/m
seed: 5
single_copy: false
vllm:
  dtype: float32
  enforce_eager: true
  enable_prefix_caching: false
  max_model_len: 2048
  weight_bridge_mode: none
  bridge_config: /runs/x/vllm_bridge_config.json
""",
    )
    argv = expand_files(
        ["--dtype=half", "--recipe", str(recipe), "--dtype=bfloat16", "--port", "9"]
    )
    assert argv[:2] == ["--model", "/models/m"] and "--seed" in argv  # the file's first
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert "--single-copy" not in argv and "--no-single-copy" not in argv  # bridge: store_true
    # the command line's, before or after --recipe, after the file's: they win
    assert argv[-4:] == ["--dtype=half", "--dtype=bfloat16", "--port", "9"]
    i = argv.index("--bridge-config")
    assert argv[i : i + 2] == ["--bridge-config", "/runs/x/vllm_bridge_config.json"]
    with pytest.raises(SystemExit, match="needs a FILE"):
        expand_files(["--config"])

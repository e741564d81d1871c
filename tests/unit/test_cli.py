"""settings/cli.py and settings/flags.py: flags from pydantic fields, recipes, env vars,
precedence, errors, report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import pytest
from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from settings import cli, flags
from settings.recipe import recipe_chain
from vllm_patching.serve import expand_files, merge_argv

pytestmark = pytest.mark.unit


class Gail(BaseSettings):
    """A nested settings section read from GAIL_* (like the trainer's GAIL options)."""

    model_config = SettingsConfigDict(env_prefix="GAIL_", extra="forbid")

    use: bool = False
    """Train with the discriminator reward."""
    beta: float = 0.5
    """Mixing weight."""


class Demo(BaseModel):
    """A service config with every kind of field."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model_name: str = "base"
    """Model to load."""
    seed: int = 0
    """Seed."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate, 100% documented."""
    mode: Literal["fast", "slow"] = "fast"
    """How to run."""
    tensorboard: bool = True
    """Write event files."""
    urls: list[str] = []
    """Servers."""
    cap: float | None = Field(None, validation_alias=AliasChoices("cap", "max_cap"))
    """Optional cap (also ``--max-cap``)."""
    token: str | None = Field(None, json_schema_extra=flags.from_env("DEMO_TOKEN"))
    """Secret token."""
    table: dict[str, float] = {}
    """Recipe-only mapping."""
    gail: Gail = Field(default_factory=Gail)
    """Nested section."""


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> cli.Resolved:
    parser = argparse.ArgumentParser()
    flags.add_config_flags(parser, Demo)
    ns = parser.parse_args(argv)
    return cli.resolve(
        Demo,
        section="trainer.grpo",
        config=ns.config or (),
        flags=flags.flag_values(Demo, ns),
        environ=environ or {},
    )


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_flags_follow_field_types(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _parse(
        [
            "--no-tensorboard",
            "--urls",
            "http://a,http://b",
            "--mode",
            "slow",
            "--max-cap",
            "none",
            "--gail.use",
            "--gail.beta",
            "0.25",
            "--lr",
            "0.5",
        ]
    ).config
    assert not cfg.tensorboard and cfg.urls == ["http://a", "http://b"] and cfg.mode == "slow"
    assert cfg.cap is None and cfg.gail.use and cfg.gail.beta == 0.25 and cfg.lr == 0.5
    with pytest.raises(SystemExit):  # Literal -> argparse choices
        _parse(["--mode", "medium"])
    assert "invalid choice" in capsys.readouterr().err
    assert _parse(["--table", "a=1.5"]).config.table == {"a": 1.5}  # a mapping: k=v or JSON
    with pytest.raises(SettingsError):
        _parse(["--table", "x"])
    parser = argparse.ArgumentParser()
    flags.add_config_flags(parser, Demo)
    text = parser.format_help()
    assert "Learning rate, 100% documented." in text and "--gail.beta" in text
    assert "{fast,slow}" in text


def test_precedence_defaults_recipe_config_env_flags(tmp_path: Path) -> None:
    recipe = _write(
        tmp_path / "r.yaml",
        """
model: from-recipe-shared
seed: 3
trainer:
  lr: 0.1
  grpo:
    mode: slow
    cap: 2.0
    token: recipe-token
    table: {a: 1.0}
    gail: {use: true, beta: 0.9}
""",
    )
    config = _write(tmp_path / "c.yaml", "lr: 0.2\n")
    r = _parse(
        ["--recipe", str(recipe), "--config", str(config), "--seed", "7"],
        environ={"DEMO_TOKEN": "env-token", "GAIL_BETA": "0.7"},
    )
    cfg = r.config
    assert cfg.model_name == "from-recipe-shared"  # shared key 'model' -> trainer.model_name
    assert cfg.mode == "slow" and cfg.cap == 2.0 and cfg.table == {"a": 1.0}  # recipe
    assert cfg.lr == 0.2  # files apply in order: the flat one, after, beats the run file
    assert cfg.token == "env-token" and cfg.gail.beta == 0.7  # env beats recipe and config
    assert cfg.gail.use  # nested: the recipe's other keys survive the env layer
    assert cfg.seed == 7  # flags beat everything
    r2 = _parse(["--recipe", str(recipe), "--gail.beta", "0.1"], environ={"GAIL_BETA": "0.7"})
    assert r2.config.gail.beta == 0.1 and r2.config.gail.use
    assert r.sources["seed"] == "flag" and r.sources["token"] == "environment"
    assert r.sources["lr"] == f"file {config}" and r.sources["mode"] == f"file {recipe}"
    assert _parse([]).config == Demo()


def test_report_masks_secrets_and_says_where_values_came_from(tmp_path: Path) -> None:
    r = _parse(["--seed", "4"], environ={"DEMO_TOKEN": "s3cret"})
    text = cli.report(r)
    assert "s3cret" not in text and "token: '***'" in text
    assert "#  seed: flag" in text and "seed: 4" in text
    assert "model_name: base" in text  # only secrets are masked


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modle: x\ntrainer: {}\n", "unknown top-level key 'modle'"),
        ("modle: x\n", "modle\n  Extra inputs are not permitted"),  # a flat file's key
        ("trainer:\n  grpo:\n    lr_typo: 1\n", "lr_typo\n  Extra inputs are not permitted"),
        ("trainer:\n  gail: {usee: true}\n", "gail.usee\n  Extra inputs are not permitted"),
        ("data: {directory: x}\n", "unknown key 'data.directory'"),
        ("trainer: [1, 2]\n", "section 'trainer' must be a mapping"),
        ("- a\n- b\n", "must hold a mapping"),
        ("trainer: {lr: [unclosed\n", "not valid YAML"),
        ("model: ${SHOP_R1_TEST_UNSET_VAR}\n", "model uses ${SHOP_R1_TEST_UNSET_VAR}"),
        ("trainer:\n  lr: -1\n", "invalid Demo"),
    ],
)
def test_recipe_errors_name_the_key_and_the_file(tmp_path: Path, text: str, message: str) -> None:
    recipe = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as e:
        _parse(["--recipe", str(recipe)])
    assert message in str(e.value)
    assert str(recipe) in str(e.value) or "invalid" in message


def test_recipe_base_variables_and_loops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOP_R1_TEST_DIR", "/data/x")
    _write(
        tmp_path / "base.yaml",
        "model: ${SHOP_R1_TEST_DIR}/m\nseed: 1\n"
        "trainer: {lr: 0.1, grpo: {mode: slow}}\nrewards: {components: {format: 0.5}}\n",
    )
    child = _write(
        tmp_path / "child.yaml",
        "base: base.yaml\nseed: 2\n"
        "trainer: {grpo: {cap: 1.5}}\nrewards: {components: {type: 0.3}}\n"
        "output_dir: ${SHOP_R1_TEST_UNSET_VAR:-${RUNS_DIR}}\n",
    )
    (base, lower), (path, upper) = recipe_chain(child)  # one layer per file, base first
    assert (base, path) == (tmp_path / "base.yaml", child) and "base" not in upper
    assert lower["model"] == "/data/x/m" and (lower["seed"], upper["seed"]) == (1, 2)
    assert upper["trainer"] == {"grpo": {"cap": 1.5}}
    loop = _write(tmp_path / "loop.yaml", "base: loop.yaml\n")
    with pytest.raises(SystemExit, match="loops back"):
        recipe_chain(loop)


def test_vllm_recipe_args_and_flags_win(tmp_path: Path) -> None:
    recipe = _write(
        tmp_path / "r.yaml",
        """
model: /models/m
seed: 5
output_dir: /runs/x
single_copy: false
vllm:
  dtype: float32
  enforce_eager: true
  enable_prefix_caching: false
  max_model_len: 2048
  weight_bridge_mode: none
""",
    )
    argv = expand_files(["--recipe", str(recipe), "--dtype=bfloat16", "--port", "9"])
    assert argv[:2] == ["--model", "/models/m"] and "--seed" in argv
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert "--single-copy" not in argv and "--no-single-copy" not in argv
    assert argv.count("--dtype") == 0 and argv[-3:] == ["--dtype=bfloat16", "--port", "9"]
    assert ["--bridge-config", "/runs/x/vllm_bridge_config.json"] == argv[
        argv.index("--bridge-config") : argv.index("--bridge-config") + 2
    ]
    assert merge_argv(["--a", "1", "--b"], ["--no-b", "--c", "2"]) == [
        "--a",
        "1",
        "--no-b",
        "--c",
        "2",
    ]

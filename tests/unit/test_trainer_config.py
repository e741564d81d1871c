"""Recipe + flags: YAML values, flags override them, Atropos-style names, clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.config import GrpoConfig, build_parser, config_from_args

pytestmark = pytest.mark.unit


def _parse(argv: list[str]) -> GrpoConfig:
    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    return config_from_args(GrpoConfig, parser.parse_args(argv))


def test_yaml_then_flags(tmp_path: Path) -> None:
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("lr: 1.0e-7\nbatch-size: 16\ntis_cap: 2.0\nkl_beta: 0.01\n")
    cfg = _parse(
        [
            "--config",
            str(recipe),
            "--batch-size",
            "64",
            "--tis-cap",
            "none",
            "--weight-bridge-mode",
            "lora_only",
            "--lora-r",
            "8",
            "--single-copy",
            "--inference-url",
            "http://a:1,http://b:2",
        ]
    )
    assert cfg.lr == 1e-7 and cfg.kl_beta == 0.01  # from the recipe
    assert cfg.batch_size == 64 and cfg.tis_cap is None  # flags win
    assert cfg.weight_bridge_mode == "lora_only" and cfg.lora_r == 8 and cfg.single_copy
    assert cfg.inference_urls() == ["http://a:1", "http://b:2"]
    assert _parse(["--vllm-port", "9100"]).inference_urls() == ["http://127.0.0.1:9100"]


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="lr"):
        _parse(["--lr", "fast"])
    with pytest.raises(SystemExit, match="tis_cap"):
        _parse(["--tis-cap", "0.5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_option: 1\n")
    with pytest.raises(SystemExit, match="no_such_option"):
        _parse(["--config", str(bad)])


def test_atropos_flag_names_are_aliases_listed_in_help() -> None:
    """An Atropos example-trainer user's flags work and show in --help (issue #19, item 8)."""
    cfg = _parse(
        [
            "--seq-len",
            "512",
            "--kl-coef",
            "0.02",
            "--checkpoint-interval",
            "3",
            "--clip-eps",
            "0.3",
            "--use-wandb",
            "--inference-url",
            "http://a:1",
        ]
    )
    assert cfg.max_seq_len == 512 and cfg.kl_beta == 0.02 and cfg.save_every == 3
    assert cfg.clip_low == cfg.clip_high == 0.3 and cfg.wandb_project == "shop-r1"
    assert _parse(["--use-wandb", "--wandb-project", "p"]).wandb_project == "p"
    assert _parse([]).wandb_project is None
    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    text = parser.format_help()
    for pair in (
        "--max-seq-len int, --seq-len",
        "--kl-beta float, --kl-coef",
        "--save-every int, --checkpoint-interval",
        "--clip-eps",
        "--use-wandb",
    ):
        assert pair in text, pair


def test_clip_eps_is_an_alias_that_sets_both_bounds(tmp_path: Path) -> None:
    """``clip_eps`` is no field: a file key, a flag (the service's, the launcher's dotted one,
    inside ``--trainer-args``) and an environment variable that set ``clip_low`` and
    ``clip_high``, resolved per layer while the layers merge: in one layer an explicit bound
    beats it, and a higher layer's ``clip_eps`` beats a lower layer's bound (and the other way
    round)."""
    from launch.run_config import resolve_run

    assert "clip_eps" not in GrpoConfig.model_fields
    conf = tmp_path / "grpo.yaml"
    conf.write_text("clip_eps: 0.3\nclip_high: 0.5\n")
    cfg = _parse(["--config", str(conf)])
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.5)  # one layer: the explicit bound wins
    assert "clip_eps" not in cfg.model_dump()  # written files hold the two fields only
    assert (_parse(["--clip-low", "0.1"]).clip_low, _parse([]).clip_high) == (0.1, 0.2)
    one = _parse(["--clip-high", "0.4", "--clip-eps", "0.3"])
    assert (one.clip_low, one.clip_high) == (0.3, 0.4)
    over = _parse(["--config", str(conf), "--clip-eps", "0.25"])  # a flag's over a file's
    assert (over.clip_low, over.clip_high) == (0.25, 0.25)
    under = _parse(["--config", str(conf), "--clip-low", "0.1"])  # a file's under a flag's
    assert (under.clip_low, under.clip_high) == (0.1, 0.5)
    old = tmp_path / "old.yaml"  # what the trainer wrote while clip_eps was a field
    old.write_text("clip_low: 0.1\nclip_high: 0.3\nclip_eps: null\n")
    cfg = _parse(["--config", str(old)])
    assert (cfg.clip_low, cfg.clip_high) == (0.1, 0.3)
    for argv in (["--trainer.grpo.clip-eps", "0.25"], ["--trainer-args=--clip-eps 0.25"]):
        r = resolve_run(argv, environ={})
        grpo = r.config.trainer.grpo
        assert (grpo.clip_low, grpo.clip_high) == (0.25, 0.25), argv
        assert r.sources["trainer.grpo.clip_low"] == "flag", r.sources
    run = tmp_path / "run.yaml"
    run.write_text("trainer:\n  grpo: {clip_low: 0.1, clip_high: 0.5}\n")
    r = resolve_run(["--recipe", str(run), "--trainer.grpo.clip-eps", "0.3"], environ={})
    assert (r.config.trainer.grpo.clip_low, r.config.trainer.grpo.clip_high) == (0.3, 0.3)
    environ = {"SHOP_R1_TRAINER__GRPO__CLIP_EPS": "0.3"}  # over the file, under the flag
    r = resolve_run(["--recipe", str(run), "--trainer.grpo.clip-high", "0.6"], environ=environ)
    assert (r.config.trainer.grpo.clip_low, r.config.trainer.grpo.clip_high) == (0.3, 0.6)


def test_a_clip_bound_of_zero_is_refused() -> None:
    """A zero clip range would freeze the ratio at 1: refused whether set as a bound or as
    ``clip_eps`` (which sets both)."""
    for kwargs in ({"clip_low": 0.0}, {"clip_high": -0.1}):
        with pytest.raises(ValidationError):
            GrpoConfig(**kwargs)
    with pytest.raises(SystemExit, match="clip_low"):
        _parse(["--clip-eps", "0"])


def test_clip_eps_from_the_environment_sets_both_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SHOP_R1_TRAINER__GRPO__CLIP_EPS`` sets both bounds, as ``--clip-eps`` does: in the
    run's environment (the launcher's ``resolve_run``) and in the service's own
    (``python -m trainer grpo``)."""
    from launch.run_config import resolve_run

    environ = {"SHOP_R1_TRAINER__GRPO__CLIP_EPS": "0.3"}
    grpo = resolve_run([], environ=environ).config.trainer.grpo
    assert (grpo.clip_low, grpo.clip_high) == (0.3, 0.3)
    assert _parse([]).clip_low == 0.2  # not set: the defaults
    monkeypatch.setenv("SHOP_R1_TRAINER__GRPO__CLIP_EPS", "0.3")
    cfg = _parse([])
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.3)
    assert _parse(["--clip-eps", "0.25"]).clip_high == 0.25  # a flag over the environment

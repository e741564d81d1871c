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
    recipe.write_text(
        "trainer:\n  grpo: {lr: 1.0e-7, batch_size: 16, tis_cap: 2.0, kl_beta: 0.01}\n"
    )
    cfg = _parse(
        [
            "--config",
            str(recipe),
            "--batch-size",
            "64",
            "--tis-cap",
            "null",
            "--weight-bridge-mode",
            "lora_only",
            "--lora-r",
            "8",
            "--inference-url",
            "http://a:1,http://b:2",
        ]
    )
    assert cfg.lr == 1e-7 and cfg.kl_beta == 0.01  # from the recipe
    assert cfg.batch_size == 64 and cfg.loss.tis_cap is None  # flags win
    assert cfg.weight_bridge_mode == "lora_only" and cfg.lora_r == 8 and not cfg.single_copy
    assert cfg.weights.type == "lora"  # with --single-copy: refused (test_weights_config)
    assert cfg.inference_urls() == ["http://a:1", "http://b:2"]
    assert _parse(["--vllm-port", "9100"]).inference_urls() == ["http://127.0.0.1:9100"]


def test_list_fields_take_lists_and_the_old_comma_strings(tmp_path: Path) -> None:
    """settings/lists.py: a YAML list, one comma-joined string (file, flag, variable) or a
    repeated flag give the same list."""
    urls = ["http://a:1", "http://b:2"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"trainer: {{grpo: {{inference_url: {urls}, lora_target_modules: 'q,v'}}}}\n")
    cfg = _parse(["--config", str(recipe)])
    assert cfg.inference_url == urls and cfg.lora_target_modules == ["q", "v"]
    assert _parse(["--inference-url", "http://a:1, http://b:2,"]).inference_url == urls
    assert _parse(["--inference-url", urls[0], "--inference-url", urls[1]]).inference_url == urls
    environ = {"SHOP_R1_TRAINER__GRPO__ATROPOS_METADATA_KEYS": "x, y"}
    from settings.cli import resolve_section

    assert resolve_section(GrpoConfig, "trainer.grpo", environ=environ).atropos_metadata_keys == [
        "x",
        "y",
    ]
    assert GrpoConfig().lora_target_modules == ["all-linear"]
    assert GrpoConfig().atropos_metadata_keys == [] and GrpoConfig().inference_url is None


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="lr"):
        _parse(["--lr", "fast"])
    with pytest.raises(SystemExit, match="tis_cap"):
        _parse(["--tis-cap", "0.5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {grpo: {no_such_option: 1}}\n")
    with pytest.raises(SystemExit, match="no_such_option"):
        _parse(["--config", str(bad)])
    with pytest.raises(SystemExit, match="tis_cap"):  # `none` is no word for None: `null` is
        _parse(["--tis-cap", "none"])


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
            "--use-wandb",
            "--inference-url",
            "http://a:1",
        ]
    )
    assert cfg.max_seq_len == 512 and cfg.kl_beta == 0.02 and cfg.save_every == 3
    assert cfg.wandb_project == "shop-r1"
    assert _parse(["--use-wandb", "--wandb-project", "p"]).wandb_project == "p"
    assert _parse([]).wandb_project is None
    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    text = parser.format_help()
    for pair in (
        "--max-seq-len int, --seq-len",
        "--kl-beta float, --kl-coef",
        "--save-every int, --checkpoint-interval",
        "--use-wandb",
    ):
        assert pair in text, pair


def test_clip_eps_is_gone_the_two_bounds_stay(tmp_path: Path) -> None:
    """One name per setting: Atropos' symmetric ``--clip-eps`` is no longer taken (an error,
    never ignored); ``clip_low`` and ``clip_high`` are the setting, and a bound of zero (the
    ratio frozen at 1) is refused."""
    assert "clip_eps" not in GrpoConfig.model_fields
    with pytest.raises(SystemExit):
        _parse(["--clip-eps", "0.3"])
    conf = tmp_path / "grpo.yaml"
    conf.write_text("trainer: {grpo: {clip_eps: 0.3}}\n")
    with pytest.raises(SystemExit, match="trainer.grpo.clip_eps"):
        _parse(["--config", str(conf)])
    cfg = _parse(["--clip-low", "0.1", "--clip-high", "0.3"])
    assert (cfg.loss.clip_low, cfg.loss.clip_high) == (0.1, 0.3)
    for kwargs in ({"clip_low": 0.0}, {"clip_high": -0.1}):
        with pytest.raises(ValidationError):
            GrpoConfig(**kwargs)


def test_the_loss_is_a_union_chosen_by_its_type_and_the_old_keys_still_set_it(
    tmp_path: Path,
) -> None:
    """trainer/loss_config.py: ``loss: {type: ...}``; a key the member lacks is refused naming
    it; ``policy_loss``/``clip_low``/... (file, flag, variable, Python) set the same values."""
    from launch.run_config import resolve_run
    from settings.cli import resolve_section
    from trainer.loss_config import GspoLoss

    new = _parse(["--loss.type", "gspo", "--loss.clip-low", "3e-4"]).loss
    assert new == GspoLoss(clip_low=3e-4)
    assert _parse(["--policy-loss", "gspo", "--clip-low", "3e-4"]).loss == new
    assert GrpoConfig(policy_loss="gspo", clip_low=3e-4).loss == new
    environ = {
        "SHOP_R1_TRAINER__GRPO__POLICY_LOSS": "gspo",
        "SHOP_R1_TRAINER__GRPO__CLIP_LOW": "3e-4",
    }
    assert resolve_section(GrpoConfig, "trainer.grpo", environ=environ).loss == new
    run = resolve_run(["--trainer-args=--policy-loss gspo --clip-low 3e-4"], environ={})
    assert run.trainer.grpo.loss == new
    old = tmp_path / "old.yaml"
    old.write_text("trainer: {grpo: {policy_loss: gspo, clip_low: 0.1}}\n")
    # each layer is renamed before they merge: a flag in the new spelling beats the file's old
    assert _parse(["--config", str(old), "--loss.clip-low", "3e-4"]).loss == new
    assert _parse(["--config", str(old)]).loss == GspoLoss(clip_low=0.1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {grpo: {loss: {type: cispo, clip_low: 1.0, only_gspo: 1}}}\n")
    with pytest.raises(SystemExit, match=r"trainer\.grpo\.loss\.only_gspo \(set by file"):
        _parse(["--config", str(bad)])
    both = tmp_path / "both.yaml"
    both.write_text("trainer: {grpo: {clip_low: 0.1, loss: {clip_low: 0.2}}}\n")
    with pytest.raises(SystemExit, match="clip_low and trainer.grpo.loss.clip_low are one"):
        _parse(["--config", str(both)])
    with pytest.raises(SystemExit, match=r"loss.type \(old key: policy_loss\) is one of ppo"):
        _parse(["--policy-loss", "grpo"])

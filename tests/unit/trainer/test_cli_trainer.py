"""Trainer options: --resume / --resume-from-checkpoint, --max-eval-samples, the hub push
decision, env-var tokens, and the API/env command lines on the shared helper."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from env_server.config import parse_config as parse_env
from env_server.reward import RewardConfig
from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args
from trainer.hub import LOCAL_ONLY, push_checkpoint, upload_kwargs
from trainer.resume import resume_checkpoint

pytestmark = pytest.mark.unit


def _parse(cls, argv: list[str]):
    parser = argparse.ArgumentParser()
    build_parser(cls, parser)
    return config_from_args(cls, parser.parse_args(argv))


def _ckpt(save: Path, step: int) -> Path:
    d = save / "checkpoints" / f"step_{step:06d}"
    (d / "model").mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    return d


def test_resume_flags() -> None:
    """One field, ``resume``: ``--resume`` alone is ``latest``, ``--resume-from-checkpoint`` its
    declared alias; ``true``/``false`` (a file, the environment) are ``latest``/unset."""
    assert _parse(SftConfig, []).resume is None
    assert _parse(SftConfig, ["--resume"]).resume == "latest"
    assert _parse(SftConfig, ["--resume", "--lr", "0.1"]).resume == "latest"
    assert _parse(GrpoConfig, ["--resume", "/x/step_000004"]).resume == "/x/step_000004"
    new = _parse(GrpoConfig, ["--resume-from-checkpoint", "/x/step_000004"])
    assert new.resume == "/x/step_000004"
    assert SftConfig(resume=True).resume == "latest" and SftConfig(resume=False).resume is None
    assert SftConfig.model_validate({"resume_from_checkpoint": "latest"}).resume == "latest"
    assert "resume_from_checkpoint" not in SftConfig.model_fields
    with pytest.raises(SystemExit, match="resume_from_checkpoint"):
        _parse(SftConfig, ["--resume-from-checkpoint", " "])


def test_resume_checkpoint_resolution(tmp_path: Path) -> None:
    save, other = tmp_path / "run", tmp_path / "other"
    cfg = SftConfig(save_path=str(save), resume=True)
    assert resume_checkpoint(cfg) is None  # latest, nothing yet: start fresh
    first, last = _ckpt(save, 2), _ckpt(save, 4)
    assert resume_checkpoint(cfg) == last
    path_cfg = SftConfig(save_path=str(save), resume=str(last))
    assert resume_checkpoint(path_cfg) == last.resolve()
    assert (
        resume_checkpoint(SftConfig(save_path=str(save), resume=str(save))) == last.resolve()
    )  # a run directory: its newest checkpoint
    with pytest.raises(SystemExit, match="not the newest"):
        resume_checkpoint(SftConfig(save_path=str(save), resume=str(first)))
    foreign = _ckpt(other, 9)
    with pytest.raises(SystemExit, match="another run"):
        resume_checkpoint(SftConfig(save_path=str(save), resume=str(foreign)))
    got = resume_checkpoint(SftConfig(save_path=str(save), resume=str(foreign), overwrite=True))
    assert got == foreign.resolve() and not (save / "checkpoints").exists()
    assert foreign.is_dir()  # the checkpoint resumed from is never touched
    fresh = SftConfig(save_path=str(tmp_path / "new"), resume=str(foreign))
    assert resume_checkpoint(fresh) == foreign.resolve()
    with pytest.raises(SystemExit, match="no such directory"):
        resume_checkpoint(SftConfig(save_path=str(save), resume="/nope/x"))
    with pytest.raises(SystemExit, match="not a checkpoint directory"):
        resume_checkpoint(SftConfig(save_path=str(save), resume=str(tmp_path)))


def test_max_eval_samples_caps_every_sft_evaluation() -> None:
    cfg = _parse(SftConfig, ["--max-eval-samples", "5", "--eval-examples", "64"])
    assert (cfg.eval_examples, cfg.eval_generate) == (5, 5)
    assert _parse(SftConfig, ["--max-eval-samples", "100"]).eval_examples == 64
    assert parse_env(["--max-eval-samples", "7"]).eval_samples == 7


def test_hub_push_is_skipped_unless_configured(tmp_path: Path) -> None:
    ckpt = _ckpt(tmp_path, 3)
    calls: list[dict] = []
    cfg = SftConfig(save_path=str(tmp_path))
    assert upload_kwargs(cfg, ckpt) is None
    assert push_checkpoint(cfg, ckpt, upload=lambda **kw: calls.append(kw)) is None and not calls


def test_hub_push_arguments_and_token_from_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    cfg = _parse(SftConfig, ["--hub-repo-id", "me/shop-r1", "--save-path", str(tmp_path)])
    assert cfg.hub_token == "hf_from_env"
    assert "hf_from_env" not in cfg.model_dump_json()  # never written to trainer_config.json
    ckpt = _ckpt(tmp_path, 3)
    calls: list[dict] = []
    push_checkpoint(cfg, ckpt, upload=lambda **kw: calls.append(kw) or "commit")
    assert calls == [
        {
            "repo_id": "me/shop-r1",
            "repo_type": "model",
            "folder_path": str(ckpt),
            "path_in_repo": "checkpoints/step_000003",
            "commit_message": f"step_000003 ({tmp_path.name})",
            "ignore_patterns": LOCAL_ONLY,
            "token": "hf_from_env",
        }
    ]
    with pytest.raises(SystemExit, match="owner/name"):
        _parse(SftConfig, ["--hub-repo-id", "noslash"])


def test_hub_push_failure_is_logged_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The real huggingface_hub path in its documented offline mode (no network here)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ckpt = _ckpt(tmp_path, 1)
    cfg = SftConfig(save_path=str(tmp_path), hub_repo_id="me/offline-test", hub_token="hf_x")
    with caplog.at_level(logging.WARNING, logger="trainer.hub"):
        assert push_checkpoint(cfg, ckpt) is None
    assert "OfflineModeIsEnabled" in caplog.text and ckpt.is_dir()


def test_tokens_come_from_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOP_R1_API_TOKEN", "api-env")
    monkeypatch.setenv("SHOP_R1_BRIDGE_TOKEN", "bridge-env")
    cfg = _parse(GrpoConfig, [])
    assert (cfg.api_token, cfg.bridge_token) == ("api-env", "bridge-env")
    assert _parse(GrpoConfig, ["--bridge-token", "flag"]).bridge_token == "flag"


def test_env_service_reward_is_given_once(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("env:\n  rewards:\n    components: {exact_match: 1.0}\n")
    assert parse_env(["--recipe", str(recipe)]).reward_config().weights == {"exact_match": 1.0}
    # a later layer's choice replaces the recipe's reward whole (flag > recipe), never merges
    flag = parse_env(["--recipe", str(recipe), "--reward-variant", "no_dars"])
    assert flag.rewards is None and flag.reward_config() == RewardConfig.variant("no_dars")
    # ... and a recipe that gives the reward twice in itself is refused
    both = tmp_path / "both.yaml"
    both.write_text("env:\n  rewards: {components: {exact_match: 1.0}}\n  reward_variant: binary\n")
    with pytest.raises(SystemExit, match="give the reward once"):
        parse_env(["--recipe", str(both)])
    bad = tmp_path / "bad.yaml"
    bad.write_text("env:\n  rewards:\n    components: {formatt: 1.0}\n")
    with pytest.raises(SystemExit, match="unknown reward component"):
        parse_env(["--recipe", str(bad)])


def test_resume_set_without_validation_still_means_latest(tmp_path: Path) -> None:
    last = _ckpt(tmp_path, 1)
    cfg = SftConfig(save_path=str(tmp_path)).model_copy(update={"resume": True})
    assert resume_checkpoint(cfg) == last


def test_gail_section_recipe_env_and_dotted_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  grpo:\n    gail: {use: false, weight: 0.3}\n")
    monkeypatch.setenv("GAIL_USE", "1")
    cfg = _parse(GrpoConfig, ["--recipe", str(recipe)])
    assert not cfg.gail.use and cfg.gail.weight == 0.3  # GAIL_USE is a default: the file wins
    cfg = _parse(GrpoConfig, [])
    assert cfg.gail.use and cfg.gail.weight == 0.5  # ... where no file sets it
    cfg = _parse(GrpoConfig, ["--recipe", str(recipe), "--no-gail.use", "--gail.alpha", "2"])
    assert not cfg.gail.use and cfg.gail.alpha == 2.0 and cfg.gail.weight == 0.3

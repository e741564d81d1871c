"""trainer/weights_config.py: ``trainer.grpo.weights`` is a union chosen by its ``type``; the
old ``weight_bridge_mode`` + ``single_copy`` pair and ``reload_every`` (file, flag, variable,
run-level shortcut, Python) choose the same member; impossible combinations are refused when
the config is read, naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from launch.run_config import resolve_run
from settings.cli import resolve_section
from trainer.config import GrpoConfig, build_parser, config_from_args
from trainer.weights_config import (
    BroadcastWeights,
    LoraWeights,
    ReloadWeights,
    SingleCopyWeights,
)

pytestmark = pytest.mark.unit

OLD = [  # (weight_bridge_mode, single_copy) -> the member
    ("shared_vllm", False, BroadcastWeights()),
    ("shared_vllm", True, SingleCopyWeights()),
    ("lora_only", False, LoraWeights()),
    ("none", False, ReloadWeights()),
]


def _parse(argv: list[str]) -> GrpoConfig:
    parser = argparse.ArgumentParser()
    build_parser(GrpoConfig, parser)
    return config_from_args(GrpoConfig, parser.parse_args(argv))


@pytest.mark.parametrize(("mode", "single", "member"), OLD)
def test_each_old_spelling_is_its_member(
    mode: str, single: bool, member: object, tmp_path: Path
) -> None:
    flags = ["--weight-bridge-mode", mode] + (["--single-copy"] if single else [])
    assert _parse(flags).weights == member
    assert _parse(["--weights.type", member.type]).weights == member  # type: ignore[attr-defined]
    assert GrpoConfig(weight_bridge_mode=mode, single_copy=single).weights == member
    environ = {
        "SHOP_R1_TRAINER__GRPO__WEIGHT_BRIDGE_MODE": mode,
        "SHOP_R1_TRAINER__GRPO__SINGLE_COPY": str(single).lower(),
    }
    assert resolve_section(GrpoConfig, "trainer.grpo", environ=environ).weights == member
    file = tmp_path / "old.yaml"
    file.write_text(f"trainer: {{grpo: {{weight_bridge_mode: {mode}, single_copy: {single}}}}}\n")
    cfg = _parse(["--config", str(file)])
    assert cfg.weights == member
    assert (cfg.weight_bridge_mode, cfg.single_copy) == (mode, single)  # read back
    shortcut = ["--weight-bridge-mode", mode] + (["--single-copy"] if single else [])
    run = resolve_run(shortcut, environ={})
    assert run.trainer.grpo.weights == member and run.vllm.weight_bridge_mode == mode
    trainer_args = f"--trainer-args=--weight-bridge-mode {mode}" + (" --single-copy" * single)
    assert resolve_run([trainer_args], environ={}).trainer.grpo.weights == member


def test_reload_every_and_its_atropos_name_set_the_reload_member(tmp_path: Path) -> None:
    want = ReloadWeights(reload_every=3)
    assert _parse(["--weights.type", "reload", "--weights.reload-every", "3"]).weights == want
    assert _parse(["--weight-bridge-mode", "none", "--reload-every", "3"]).weights == want
    assert _parse(["--weight-bridge-mode", "none", "--vllm-restart-interval", "3"]).weights == want
    assert GrpoConfig(weight_bridge_mode="none", reload_every=3).weights == want
    assert GrpoConfig(weight_bridge_mode="none", reload_every=3).reload_every == 3
    assert GrpoConfig().reload_every == 1  # every sync, for the transports without the field


def test_each_layer_completes_the_old_pair_from_the_layers_below(tmp_path: Path) -> None:
    """Precedence holds across spellings: a flag giving only ``--single-copy`` over a file's
    ``weight_bridge_mode: shared_vllm``, or the new spelling over the old, as before."""
    old = tmp_path / "old.yaml"
    old.write_text("trainer: {grpo: {weight_bridge_mode: shared_vllm, single_copy: false}}\n")
    assert _parse(["--config", str(old), "--single-copy"]).weights == SingleCopyWeights()
    assert _parse(["--config", str(old), "--weights.type", "lora"]).weights == LoraWeights()
    new = tmp_path / "new.yaml"
    new.write_text("trainer: {grpo: {weights: {type: single_copy}}}\n")
    cfg = _parse(["--config", str(new), "--weight-bridge-mode", "shared_vllm"])
    assert cfg.weights == SingleCopyWeights()  # single_copy came from the layer below
    cfg = _parse(["--config", str(new), "--no-single-copy"])
    assert cfg.weights == BroadcastWeights()


def test_a_field_of_another_transport_is_refused_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {grpo: {weights: {type: broadcast, reload_every: 2}}}\n")
    with pytest.raises(SystemExit, match=r"trainer\.grpo\.weights\.reload_every \(set by file"):
        _parse(["--config", str(bad)])
    old = tmp_path / "old.yaml"
    old.write_text("trainer: {grpo: {weight_bridge_mode: shared_vllm, reload_every: 2}}\n")
    with pytest.raises(SystemExit, match=r"trainer\.grpo\.weights\.reload_every \(set by file"):
        _parse(["--config", str(old)])
    with pytest.raises(ValidationError, match="reload_every"):
        GrpoConfig(weight_bridge_mode="lora_only", reload_every=2)
    with pytest.raises(SystemExit, match=r"weights\.type \(old keys: weight_bridge_mode"):
        _parse(["--weights.type", "nccl"])


def test_single_copy_with_another_mode_is_refused_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {grpo: {weight_bridge_mode: lora_only, single_copy: true}}\n")
    with pytest.raises(SystemExit, match=rf"file {bad}: trainer\.grpo\.single_copy: true only"):
        _parse(["--config", str(bad)])
    with pytest.raises(SystemExit, match=r"trainer\.grpo\.single_copy: true only applies"):
        _parse(["--weight-bridge-mode", "none", "--single-copy"])
    with pytest.raises(SystemExit, match="single_copy: true only applies"):
        resolve_run(["--weight-bridge-mode", "lora_only", "--single-copy"], environ={})
    with pytest.raises(ValidationError, match="single_copy: true only applies"):
        GrpoConfig(weight_bridge_mode="lora_only", single_copy=True)
    both = tmp_path / "both.yaml"
    both.write_text("trainer: {grpo: {weight_bridge_mode: none, weights: {type: lora}}}\n")
    with pytest.raises(SystemExit, match="weights.type lora and the old"):
        _parse(["--config", str(both)])


def test_the_written_config_names_the_member_only() -> None:
    """``trainer_config.json`` and the run files hold ``weights``, not the old pair."""
    dumped = GrpoConfig(weight_bridge_mode="none", reload_every=2).model_dump(mode="json")
    assert dumped["weights"] == {"type": "reload", "reload_every": 2}
    assert not {"weight_bridge_mode", "single_copy", "reload_every"} & dumped.keys()
    assert GrpoConfig.model_validate(dumped).weights == ReloadWeights(reload_every=2)


def test_every_member_has_its_bridge_and_make_bridge_refuses_what_none_has() -> None:
    """trainer/bridge/: one builder per ``weights.type``; the old spelling's impossible
    combinations are refused before a server is asked anything."""
    from trainer.bridge import TRANSPORTS, make_bridge
    from trainer.weights_config import BY_TYPE

    assert TRANSPORTS.keys() == BY_TYPE.keys()
    with pytest.raises(ValueError, match="single_copy: true only applies"):
        make_bridge("lora_only", ["http://127.0.0.1:1"], single_copy=True, save_dir="s")
    with pytest.raises(ValidationError, match="reload_every"):
        make_bridge("shared_vllm", ["http://127.0.0.1:1"], reload_every=3)

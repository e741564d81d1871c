"""The launcher and who may reach the run's services (issue 48): ``make run`` stays on
loopback with no API token; an exposed API fails before anything starts unless it has a token
(which then reaches the API, the env and the trainer through their environment, never a file)
or the opt-out, which reaches the services' files as typed fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from api.config import TOKEN_ENV, check_exposure
from api.config import parse_config as parse_api
from launch import run_all, run_plan
from launch.configs import resolve_for_run, write_service_configs
from vllm_patching.serve import build

pytestmark = pytest.mark.unit


def _files(argv: list[str], run_dir: Path, environ: dict[str, str] | None = None):
    cfg = resolve_for_run(
        argv, "http://127.0.0.1:1", ["http://127.0.0.1:2"], run_dir, environ=environ
    )
    return cfg, write_service_configs(run_dir, cfg)


def test_the_default_run_is_loopback_without_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg, files = _files([], tmp_path, environ={})
    api = parse_api(["--config", str(files["api"])])
    assert (api.host, api.token, api.insecure_no_token) == ("127.0.0.1", None, False)
    assert check_exposure(api) is None and run_plan.api_token_env(cfg.api) == {}
    assert run_plan.api_connect_host(api.host) == "127.0.0.1"


def test_the_opt_outs_reach_the_services_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--api.insecure-no-token`` and ``--vllm.insecure-no-token`` are typed fields that the
    run's files carry (not mistaken for secrets and dropped), and each service reads them."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    argv = ["--api.host", "0.0.0.0", "--api.insecure-no-token", "--vllm.insecure-no-token"]
    _, files = _files(argv, tmp_path, environ={})
    assert yaml.safe_load(files["api"].read_text())["api"]["insecure_no_token"] is True
    api = parse_api(["--config", str(files["api"])])
    assert api.host == "0.0.0.0" and "INSECURE" in (check_exposure(api) or "")
    assert yaml.safe_load(files["vllm"].read_text())["vllm"]["insecure_no_token"] is True
    settings, _, _ = build(
        ["--model", "m", "--bridge-device", "cpu", "--config", str(files["vllm"])], environ={}
    )
    assert settings.insecure_no_token


def test_an_api_token_travels_by_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg, files = _files(["--api.host", "0.0.0.0", "--api.token", "t0k3n"], tmp_path, environ={})
    assert "t0k3n" not in "".join(p.read_text() for p in files.values())
    assert cfg.api.token == "t0k3n" and check_exposure(cfg.api) is None
    assert run_plan.api_token_env(cfg.api) == {TOKEN_ENV: "t0k3n"}
    monkeypatch.setenv(TOKEN_ENV, "t0k3n")  # what the launcher puts in the API's environment
    assert parse_api(["--config", str(files["api"])]).token == "t0k3n"


@pytest.mark.parametrize(
    ("host", "connect"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("::", "127.0.0.1"),
        ("10.0.0.5", "10.0.0.5"),
        ("fd00::5", "[fd00::5]"),
        ("node7", "node7"),
    ],
)
def test_the_runs_services_reach_the_api_where_it_listens(host: str, connect: str) -> None:
    assert run_plan.api_connect_host(host) == connect


def test_an_exposed_api_without_a_token_stops_the_launcher_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    run_dir = tmp_path / "run"
    assert run_all.main(["--api.host", "0.0.0.0", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "[run_all] FAILED" in err and "refusing to serve on '0.0.0.0'" in err
    assert "--api.token" in err and "--insecure-no-token" in err
    assert not run_dir.exists()  # nothing made, nothing started

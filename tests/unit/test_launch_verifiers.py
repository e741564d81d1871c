"""launch/run_all.sh with a verifiers environment (docs/VERIFIERS.md): the run's
``verifiers:`` section resolved once with the launcher's wiring, its service file, the vLLM
flag verifiers' renderer needs, the held-out evaluation's command and its before/after table.
The run itself: tests/integration/test_launch_verifiers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from env_server.verifiers.config import parse_config
from env_server.verifiers.evaluate import parse as parse_eval
from launch import verifiers_env
from launch.configs import resolve_for_run, write_service_configs
from launch.prepare import prepares_embedded
from launch.run_all import vllm_extra
from settings.paths import REPO_ROOT, SMOL_MODEL_DIR

pytestmark = pytest.mark.unit
RECIPE = REPO_ROOT / "recipes" / "smollm2-135m-instruct" / "guess_number" / "multiturn.yaml"
ARGV = ["--preset", "cpu-smol", "--recipe", str(RECIPE)]


def test_the_guess_number_recipe_wires_a_verifiers_run_instead_of_shop_r1(tmp_path: Path) -> None:
    cfg = resolve_for_run(ARGV, "http://127.0.0.1:8001", ["http://127.0.0.1:9001"], tmp_path)
    v = cfg.verifiers
    assert v is not None and v.env_id == "guess_number"
    assert (v.api_url, v.inference_url) == ("http://127.0.0.1:8001", "http://127.0.0.1:9001")
    assert v.metrics_path == tmp_path / "verifiers_metrics.jsonl"
    assert v.env_path == [REPO_ROOT / "examples" / "verifiers_envs" / "guess_number"]
    assert not cfg.launch.shop_r1_env and cfg.model == str(SMOL_MODEL_DIR)
    assert prepares_embedded(cfg)  # the base model is built if missing; no dataset, no SFT
    assert "--enable-scale-out" in vllm_extra(cfg)
    # the service reads back exactly the section the launcher resolved
    files = write_service_configs(tmp_path, cfg)
    assert parse_config(["--config", str(files["verifiers"])]) == v
    assert "token" not in yaml.safe_load(files["verifiers"].read_text())["verifiers"]


def test_a_run_without_verifiers_gets_neither_the_file_nor_the_flag(tmp_path: Path) -> None:
    cfg = resolve_for_run([], "http://127.0.0.1:8001", ["http://127.0.0.1:9001"], tmp_path)
    assert cfg.verifiers is None and cfg.launch.shop_r1_env
    assert "verifiers" not in write_service_configs(tmp_path, cfg)
    assert "--enable-scale-out" not in vllm_extra(cfg)


def test_the_evaluation_runs_the_run_env_on_its_held_out_split(tmp_path: Path) -> None:
    cfg = resolve_for_run(ARGV, "http://127.0.0.1:8001", ["http://127.0.0.1:9001"], tmp_path)
    argv = verifiers_env.evaluation_argv(cfg, "http://127.0.0.1:9001", tmp_path / "e.jsonl")
    assert argv[1:3] == ["-m", "env_server.verifiers.evaluate"]
    got = parse_eval(argv[3:])
    assert got.env_id == "guess_number" and json.loads(got.env_args) == {"split": "test"}
    assert got.samples == cfg.launch.verifiers_eval_samples
    assert (got.temperature, got.max_tokens) == (0.7, 8)  # the training rollouts'
    assert got.env_path == cfg.verifiers.env_path and got.out == tmp_path / "e.jsonl"


def _episodes(path: Path, rewards: list[float]) -> Path:
    rows = [
        {"kind": "episode", "task": i % 2, "sample": i, "reward": r, "turns": 2.0, "error": None}
        for i, r in enumerate(rewards)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"kind": "summary"}]))
    return path


def test_the_before_after_table(tmp_path: Path) -> None:
    before = _episodes(tmp_path / "b.jsonl", [0.0, 0.0, 1.0, 0.0])
    after = _episodes(tmp_path / "a.jsonl", [1.0, 0.5, 1.0, 0.0])
    got = verifiers_env.compare(before, after)
    assert got["reward"]["before"] == 0.25 and got["reward"]["after"] == 0.625
    assert got["reward"]["difference"] == pytest.approx(0.375)
    # two independent samples: sqrt(var_b / n + var_a / n), sample variances
    assert got["reward"]["se"] == pytest.approx((0.25 / 4 + 0.2291667 / 4) ** 0.5, rel=1e-5)
    assert got["solved"]["before"] == 0.25 and got["solved"]["after"] == 0.75
    text = verifiers_env.table(got, "note.")
    assert "| mean episode reward | 0.250 | 0.625 | +0.375 |" in text
    assert text.endswith("4 / 4 episodes. note.\n")

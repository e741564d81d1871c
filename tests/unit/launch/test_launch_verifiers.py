"""launch/run_all.sh with a verifiers environment (docs/VERIFIERS.md): the run's
``verifiers:`` section resolved once with the launcher's wiring, its service file, the vLLM
flag verifiers' renderer needs, the held-out evaluation's command and its before/after table.
The run itself: tests/integration/launch/test_launch_verifiers.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from env_server.verifiers.compare import compare, read_episodes, table
from env_server.verifiers.config import parse_config
from env_server.verifiers.evaluate import parse as parse_eval
from launch import verifiers_env
from launch.configs import resolve_for_run, write_service_configs
from launch.prepare import prepares_embedded
from launch.run_plan import vllm_extra
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
    assert got.wait_for_server_s == 0  # the server must be up unless the launcher says
    # the launcher starts the "before" one with vLLM: it waits for /health that long
    assert parse_eval([*argv[3:], "--wait-for-server-s", "600"]).wait_for_server_s == 600


def _episodes(rewards: list[float], turns: float = 2.0) -> list[dict]:
    return [
        {"kind": "episode", "task": i % 2, "sample": i, "reward": r, "turns": turns, "error": None}
        for i, r in enumerate(rewards)
    ]


def test_the_before_after_table_is_stratified_by_task(tmp_path: Path) -> None:
    # task 0: episodes 0, 2; task 1: episodes 1, 3
    before = _episodes([0.0, 0.0, 1.0, 0.0])
    after = _episodes([1.0, 0.5, 1.0, 0.0], turns=3.0)
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*before, {"kind": "summary"}]))
    assert read_episodes(path) == before
    got = compare(before, after)
    assert got["tasks"] == 2 and got["episodes"] == [4, 4] and got["failed"] == [0, 0]
    assert got["reward"]["before"] == 0.25 and got["reward"]["after"] == 0.625
    assert got["reward"]["difference"] == pytest.approx(0.375)
    # per task: var_b / 2 + var_a / 2 (sample variances); task 0: 0.5/2 + 0; task 1: 0 + 0.125/2
    assert got["reward"]["se"] == pytest.approx((0.25 + 0.0625) ** 0.5 / 2)
    assert got["solved"]["before"] == 0.25 and got["solved"]["after"] == 0.75
    assert got["turns"]["difference"] == 1.0 and got["turns"]["z"] == math.inf
    text = table(got, "note.")
    assert "| mean episode reward | 0.250 | 0.625 | +0.375 |" in text
    assert "2 held-out tasks, 4 / 4 episodes (0 / 0 failed" in text and text.endswith("note.\n")


def test_solved_is_the_rows_own_where_it_has_one() -> None:
    # partial credit (a format reward) is not a win
    before = [{**r, "solved": False} for r in _episodes([0.2, 0.0, 0.1, 0.0])]
    after = [{**r, "solved": r["reward"] == 1.0} for r in _episodes([1.0, 0.2, 1.0, 0.1])]
    got = compare(before, after)
    assert got["solved"]["before"] == 0.0 and got["solved"]["after"] == 0.5


def test_task_difficulty_cancels_out() -> None:
    # the hard task's episodes all score 0, the easy one's 1 on both sides: no difference, and
    # the spread between tasks is not noise
    same = _episodes([1.0, 0.0] * 3)
    got = compare(same, same)
    assert got["reward"]["difference"] == 0.0 and got["reward"]["se"] == 0.0
    assert got["reward"]["z"] == 0.0


def test_a_comparison_needs_two_episodes_of_a_task_a_side() -> None:
    with pytest.raises(ValueError, match="--samples >= 2"):
        compare(_episodes([1.0, 0.0]), _episodes([1.0, 0.0]))

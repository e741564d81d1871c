"""launch/run_all.sh with a 2-rank trainer (``--trainer-procs 2``: torchrun, FSDP2 on gloo)
driving the real vLLM CPU server, in shared_vllm (broadcast) and lora_only, one after the
other (the expensive test of trainer/distributed.py; ~the cost of two run_all runs).

Each run: two GRPO steps at lr 1e-2 (the weights move far: KL ~10 at step 2), every step
checkpointed (sharded, ``dcp/``), gathered to rank 0 and synced (the server reports weight
version 2), every process gone at the end (``check_run``); then vLLM's greedy completions of
the RL evaluation (``eval_rl/predictions.jsonl``, asked of the server after the last sync)
equal transformers' greedy generation from the trainer's last checkpoint (its ``model/``
export: the whole model, or the adapter on the SFT base). The 3-step SFT model of the
shared fixture answers the same degenerate text before and after such an update, so this
comparison cannot by itself reveal a sync that never happened; the bitwise check that the
gather fills rank 0's replica with the trained weights is in test_trainer_fsdp.py, and the
bridge's token-level check of what vLLM serves in test_bridge_modes.py. Under LoRA the
fixture's rollouts all score 0 with no rationale span, so every advantage is 0, the adapter's
B stays 0 and the run checks the plumbing (2 ranks, gather, adapter per version, versions),
not a moved policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.launcher_harness import LauncherRun
from tests.integration.test_launch_run_all import (
    STEPS,
    artifacts_env,
    check_run,
    launcher,
    run_all,
)

pytestmark = pytest.mark.integration
EVAL = 2
PROMPT_TOKENS, MAX_TOKENS = 928, 96  # the cpu-tiny preset's evaluation budget
__all__ = ["artifacts_env", "launcher"]  # fixtures shared with test_launch_run_all


@torch.no_grad()
def transformers_greedy(model_dir: Path, ckpt_model: Path, data_dir: Path, lora: bool) -> list:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from env_server.data.dataset import load_or_build
    from env_server.rollout import prompt_ids

    model = AutoModelForCausalLM.from_pretrained(
        ckpt_model if not lora else model_dir, dtype=torch.float32
    )
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, ckpt_model)
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_or_build(data_dir)["test"].to_list()[:EVAL]
    texts = []
    for row in rows:
        ids = prompt_ids(row, tok, PROMPT_TOKENS, False)
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        texts.append(tok.decode(out[0, len(ids) :], skip_special_tokens=True))
    return texts


def test_two_rank_trainer_drives_vllm_in_shared_vllm_and_lora_only(
    artifacts_env: dict[str, str], launcher: Callable[..., LauncherRun], tmp_path: Path
) -> None:
    root = Path(artifacts_env["SHOP_R1_ARTIFACTS"])
    sft = root / "models" / "tiny-qwen2-sft"
    for mode in ("shared_vllm", "lora_only"):
        run_dir = tmp_path / mode
        out = run_all(
            launcher,
            run_dir,
            artifacts_env,
            "--trainer-procs",
            "2",
            "--weight-bridge-mode",
            mode,
            "--eval-samples",
            str(EVAL),
            "--trainer-args=--lr 1e-2",
        )
        check_run(run_dir, out, ["vllm"])
        log = (run_dir / "trainer.log").read_text()
        assert "rank 0 of 2" in log and "rank 1 of 2" in log, log[-3000:]
        rows = [
            json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
        ]
        assert all(r["gather_s"] >= 0 and r["sync_s"] > 0 for r in rows)
        ckpt = run_dir / "trainer" / "checkpoints" / f"step_{STEPS:06d}"
        assert (ckpt / "dcp" / ".metadata").is_file()
        preds = (run_dir / "eval_rl" / "predictions.jsonl").read_text().splitlines()
        served = [json.loads(x)["completion"] for x in preds]
        want = transformers_greedy(
            sft, ckpt / "model", root / "data" / "shop_r1", lora=mode == "lora_only"
        )
        assert served == want, mode

"""launch/run_all.sh with a 2-rank trainer (``--trainer-procs 2``: torchrun, FSDP2 on gloo)
driving real vLLM CPU servers, in shared_vllm (broadcast to two servers, NUM_INFERENCE_NODES=2)
and lora_only (one server), one after the other (the expensive test of trainer/distributed.py;
~the cost of two run_all runs). These are the suite's launcher runs of ``lora_only`` and of
the multi-server path (test_launch_run_all.py runs the other modes). The shared_vllm run also
checks the env's rollouts spread over both servers, the SFT-vs-RL evaluation table, the reward
curve and what the user sees (test_launch_run_all's ``check_what_the_user_sees``).

Each run: two GRPO steps at lr 1e-2 (the weights move far: KL 0.5-10 at step 2), every step
checkpointed (sharded, ``dcp/``), gathered to rank 0 and synced (every server reports weight
version 2), every process gone at the end (``check_run``); then vLLM's greedy completions of
the RL evaluation (the token ids in ``eval_rl/predictions.jsonl``, asked of the servers after
the last sync) equal transformers' greedy generation from the trainer's last checkpoint (its
``model/`` export: the whole model, or the adapter on the SFT base). Token ids, not text: a
run once ended on a model repeating one byte-level token, which transformers decodes to
U+FFFD and vLLM to nothing, so equal tokens gave unequal text (suite_timings.md, U).

The 3-step SFT model of the shared fixture answers the same degenerate text before and after
such an update, so the greedy comparison alone cannot reveal a sync that never happened. The
sensitive check: once the launcher has started the trainer it only watches it, so the test
freezes the launcher then (SIGSTOP: it cannot stop vLLM, however long anything takes), waits
until the trainer has exited (its last sync done, nothing syncs again), asks every vLLM server
for the prompt logprobs of a fixed 928-token evaluation prompt, and lets the launcher go on
(SIGCONT).
The first server's logprobs must match transformers' from the last checkpoint within
``LOGPROB_TOL`` (mean absolute difference per token; the second server's the first's, too) and
differ from the start model's by more than ``MOVED_MIN``: a skipped sync fails (vLLM would
then serve the start model, more than ``MOVED_MIN - LOGPROB_TOL`` away from the checkpoint).

The weights must move for that, so the signal is made certain: the fixture's rollouts from the
3-step SFT model almost always all score 0 (no valid format), and whether a rare one scores
more depends on the CPU's kernels -- on an AVX2-only AMD EPYC every rollout of a run scored 0,
every advantage and gradient was 0 and the served model was 2.1e-7 from the start
(issue 48 point 5), where AVX-512 boxes had scored a few. The env's test-only
``score_ramp`` (``SHOP_R1_ENV__SCORE_RAMP``, ``EnvConfig.score_ramp``) adds 0, 1, 2, 3 to a
group's four scores, so every group has a spread whatever the model samples; the test also
checks each step's metrics for it (advantages and gradient norm > 0), so a run without a
signal fails there, by name, before the comparison. At lr 1e-2 Adam then moves every weight
that gets a gradient by about the learning rate, the LoRA adapter's B (zero at the start)
included. Measured with it (2026-11-28, AVX2-only AMD EPYC, 2 cores at load 8, 1,189 s):
served vs last checkpoint 3.2e-7 (shared_vllm) and 2.2e-7 (lora_only), served vs start model
0.747 and 0.152 (KL to the start 1.16 and 0.52 at step 2). Before it, without the spread
(shared_vllm on AVX-512 boxes): 0.445 and 0.799 vs start, < 5e-6 and 3.1e-7 vs checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from tests.integration.launch.test_launch_run_all import (
    STEPS,
    artifacts_env,
    check_run,
    check_what_the_user_sees,
    launcher,
)
from tests.integration.launcher_harness import LauncherRun, gone

pytestmark = pytest.mark.integration
EVAL = {"shared_vllm": 4, "lora_only": 2}
"""Test rows each run evaluates (shared_vllm: the SFT-vs-RL table's checks need 4)."""
SERVERS = {"shared_vllm": ["vllm", "vllm1"], "lora_only": ["vllm"]}
"""The vLLM servers of each run: shared_vllm broadcasts to two (NUM_INFERENCE_NODES=2)."""
PROMPT_TOKENS, MAX_TOKENS = 928, 96  # the cpu-tiny preset's evaluation budget
LOGPROB_TOL = 0.005
"""Largest mean |logprob difference| per token between vLLM and transformers on the same
weights (vLLM's CPU kernels vs transformers' fp32)."""
MOVED_MIN = 0.05
"""Smallest mean |logprob difference| per token between the synced and the start model (lr 1e-2
moves the weights far; measured: module docstring)."""
SCORE_RAMP = "1.0"
"""The env's test-only spread of each group's scores (module docstring)."""
__all__ = ["artifacts_env", "launcher"]  # fixtures shared with test_launch_run_all


def first_prompt(model_dir: Path, data_dir: Path) -> list[int]:
    """The token ids of the first test row's prompt (the evaluation's first request)."""
    from transformers import AutoTokenizer

    from env_server.data.dataset import load_or_build
    from env_server.rollout import prompt_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    return prompt_ids(load_or_build(data_dir)["test"].to_list()[0], tok, PROMPT_TOKENS, False)


def served_prompt_logprobs(run: LauncherRun, ids: list[int]) -> dict[str, list[float]]:
    """Each vLLM server's logprobs of ``ids[1:]`` once the trainer has exited (by server name,
    the first server first), asked while the launcher is frozen: frozen from the moment it
    started the trainer, so it cannot have stopped vLLM whatever the timing."""
    started = "[run_all] env + trainer started; training"
    run.wait_until(lambda: started in run.output(), "the trainer's start")
    trainer = int(run.pids()["trainer"]["pid"])  # written before the line above
    os.kill(run.pid, signal.SIGSTOP)
    try:
        run.wait_until(lambda: gone(trainer), "the trainer's end (the launcher frozen)")
        urls = dict(re.findall(r"\[run_all\] (vllm\d*) up at (\S+)", run.output()))
        got = {name: _prompt_logprobs(url, ids) for name, url in urls.items()}
    finally:
        os.kill(run.pid, signal.SIGCONT)
    return got


def _prompt_logprobs(url: str, ids: list[int]) -> list[float]:
    name = httpx.get(f"{url}/bridge/info", timeout=30).json()["served_model"]
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    rows = got["choices"][0]["prompt_logprobs"][1:]
    return [row[str(t)]["logprob"] for row, t in zip(rows, ids[1:], strict=True)]


@torch.no_grad()
def transformers_logprobs(model_dir: Path, ckpt_model: Path | None, lora: bool, ids: list) -> list:
    """fp32 logprobs of ``ids[1:]``: the start model (``ckpt_model`` None) or a checkpoint's."""
    from transformers import AutoModelForCausalLM

    path = model_dir if ckpt_model is None or lora else ckpt_model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora and ckpt_model is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, ckpt_model)
    logits = model.eval()(input_ids=torch.tensor([ids])).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    return float(torch.tensor(a).sub(torch.tensor(b)).abs().mean())


@torch.no_grad()
def transformers_greedy(
    model_dir: Path, ckpt_model: Path, data_dir: Path, lora: bool, n: int
) -> list[list[int]]:
    """transformers' greedy completion token ids of the first ``n`` test rows (ids, not text: a
    byte-level token that is not valid UTF-8 alone decodes to U+FFFD here and to nothing in
    vLLM's incremental detokenizer, so equal tokens can give unequal text)."""
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
    rows = load_or_build(data_dir)["test"].to_list()[:n]
    completions = []
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
        completions.append(out[0, len(ids) :].tolist())
    return completions


def test_two_rank_trainer_drives_vllm_in_shared_vllm_and_lora_only(
    artifacts_env: dict[str, str], launcher: Callable[..., LauncherRun], tmp_path: Path
) -> None:
    root = Path(artifacts_env["SHOP_R1_ARTIFACTS"])
    sft = root / "models" / "tiny-qwen2-sft"
    data = root / "data" / "shop_r1"
    ids = first_prompt(sft, data)
    for mode in ("shared_vllm", "lora_only"):
        run_dir, lora, servers = tmp_path / mode, mode == "lora_only", SERVERS[mode]
        env = dict(artifacts_env, NUM_INFERENCE_NODES=str(len(servers)))
        env["SHOP_R1_ENV__SCORE_RAMP"] = SCORE_RAMP  # a GRPO signal in every group
        run = launcher(
            run_dir,
            env,
            "--training-steps",
            str(STEPS),
            "--keep-constant-groups",
            "--trainer-procs",
            "2",
            "--weight-bridge-mode",
            mode,
            "--eval-samples",
            str(EVAL[mode]),
            "--trainer-args=--lr 1e-2",
        )
        served_lps = served_prompt_logprobs(run, ids)
        assert run.wait() == 0, run.tails()
        out = run.output()
        check_run(run_dir, out, servers)
        log = (run_dir / "trainer.log").read_text()
        assert "rank 0 of 2" in log and "rank 1 of 2" in log, log[-3000:]
        rows = [
            json.loads(x) for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()
        ]
        assert all(r["gather_s"] >= 0 and r["sync_s"] > 0 for r in rows)
        signal_ = [(r["score_std"], r["advantage_abs_mean"], r["grad_norm"]) for r in rows]
        assert all(min(x) > 0 for x in signal_), f"no GRPO signal in a step: {signal_}"
        ckpt = run_dir / "trainer" / "checkpoints" / f"step_{STEPS:06d}"
        assert (ckpt / "dcp" / ".metadata").is_file()
        if lora:  # the adapters the trainer handed to vLLM, one per version
            assert (run_dir / "trainer" / "bridge" / f"v{STEPS}").is_dir()
        else:
            check_two_servers(run_dir, out, tmp_path)
        preds = (run_dir / "eval_rl" / "predictions.jsonl").read_text().splitlines()
        served = [json.loads(x)["token_ids"] for x in preds]
        want = transformers_greedy(sft, ckpt / "model", data, lora, EVAL[mode])
        assert served == want, mode
        assert list(served_lps) == servers, served_lps.keys()
        served_lp = served_lps["vllm"]
        for name in servers[1:]:  # the broadcast fed every server the same weights
            between = mean_abs_diff(served_lps[name], served_lp)
            print(f"{mode}: {name} vs vllm {between:.2e}")
            assert between < LOGPROB_TOL, (name, between)
        to_ckpt = mean_abs_diff(served_lp, transformers_logprobs(sft, ckpt / "model", lora, ids))
        to_start = mean_abs_diff(served_lp, transformers_logprobs(sft, None, lora, ids))
        print(f"{mode}: served vs last checkpoint {to_ckpt:.2e}, vs start model {to_start:.2e}")
        assert to_ckpt < LOGPROB_TOL, (mode, to_ckpt, to_start)
        assert to_start > MOVED_MIN > LOGPROB_TOL, (mode, to_ckpt, to_start)


def check_two_servers(run_dir: Path, out: str, tmp_path: Path) -> None:
    """The multi-server path on the CPU: rank 0's one broadcast group (a free port under
    torchrun) feeds both servers, the env spreads its rollouts over both; then the SFT-vs-RL
    evaluation table, the reward curve and what the user sees."""
    for name in SERVERS["shared_vllm"]:
        assert "backend=gloo_bcast" in (run_dir / f"{name}.log").read_text()
    trainer_log = (run_dir / "trainer.log").read_text()
    assert re.search(r"weight broadcast group at 127\.0\.0\.1:\d+, 3 ranks", trainer_log)
    line = next(
        x for x in (run_dir / "env.log").read_text().splitlines() if "requests per server" in x
    )
    per_server = json.loads(line.split("requests per server: ", 1)[1].replace("'", '"'))
    assert len(per_server) == 2 and all(n > 0 for n in per_server.values()), line

    n, table = EVAL["shared_vllm"], (run_dir / "eval.md").read_text()
    for label in ("exact match", "type accuracy", "macro-F1", "format rate", "mean reward"):
        assert f"| {label}" in table
    assert f"weight version {STEPS}" in table  # RL = the trainer's final weights
    pages, changed = table.split("Per page kind", 1)[1].split("What RL changed", 1)
    assert f"| **all** | | {n} |" in changed  # the same rows, per gold action and page
    counts = [
        int(r.split("|")[2]) for r in pages.splitlines() if r.startswith("| ") and "rows" not in r
    ]
    assert sum(counts) == n and "Results-page clicks that name an element" in pages, pages
    for split in ("sft", "rl"):
        assert json.loads((run_dir / f"eval_{split}" / "metrics.json").read_text())["n"] == n
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_what_the_user_sees(run_dir, out, tmp_path, n)

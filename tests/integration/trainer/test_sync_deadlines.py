"""A weight sync never hangs: each transport's phases against a real, SIGSTOPped vLLM server.

For every phase of every CPU transport (broadcast, single copy, LoRA, reload; the table in
docs/FAULT_TOLERANCE.md, "A weight sync that hangs"), the server (its API server and its
engine core) is frozen with SIGSTOP just before the phase's first call -- for certain, not
by timing: the trainer's test-only fault point (``procutil.faults.FAULT_ENV``) sends
the signal itself -- and then:

1. the sync raises ``SyncTimeout`` naming that phase, the server's URL and the phase's
   deadline (``DEADLINE``), and no other (a phase before it that hung would be named);
2. the trainer's next step, closing the bridge, returns with the server still frozen;
3. the server is continued (SIGCONT) after it has stayed frozen longer than the deadline
   (why that stands for "60 s later": docs/FAULT_TOLERANCE.md -- past the deadline the
   trainer has given up and dropped its data plane, so a longer freeze changes nothing on
   its side, and the woken server's stale calls end within its own bounded waits);
4. the next sync, from a fresh bridge as a resumed trainer builds, works, and the server
   then serves exactly the trainer's weights with their version (greedy tokens and
   logprobs equal to transformers', ``serves``): nothing half applied.

The trainer process's side -- exit 75 with the reason, only checkpointed batches acked, the
resume -- is ``test_a_frozen_server_stops_the_trainer_and_resume_continues``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from launch.lifeline import descendants
from launch.vllm_server import BridgeServer, start_bridge_server
from procutil.faults import FAULT_ENV, reset_faults
from tests.integration.bridge_checks import assert_greedy, hf_model, prompt_ids, vllm_greedy
from trainer.bridge import WeightBridge, make_bridge
from trainer.bridge.deadline import SyncTimeout
from trainer.weights_config import SyncDeadlines

pytestmark = pytest.mark.integration

TOKEN = "sync-deadline-token"
DEADLINE = 1.0
"""The deadline of the phase under test (seconds): short, so a case takes seconds. Its call
meets a server that is already frozen, so it times out at this deadline whatever its value
and however busy the box; a case waits ~3 deadlines (the phase, the frozen ``close``, the
freeze past the deadline)."""
OTHERS = {"check": 30.0, "connect": 30.0, "stage": 30.0, "transfer": 30.0, "apply": 60.0}
"""The other phases' deadlines in a faulted bridge: ample for a healthy call on a busy box."""


N_TOKENS = 4
"""Greedy tokens compared (``serves``): every layer's weights shape each one's logprob."""


def served_version(url: str) -> int:
    return int(httpx.get(f"{url}/bridge/health", timeout=60).json()["weight_version"])


@torch.no_grad()
def new_weights(model: torch.nn.Module, seed: int) -> None:
    """Move every trainable tensor (a LoRA model: its adapters) a little, as a step does
    (cheaper than an optimizer step on a busy box; the sync cannot tell them apart)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.requires_grad:  # an adapter's product of two small moves needs larger ones
            scale = 5e-2 if "lora_" in name else 2e-3
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def serves(url: str, name: str, model: torch.nn.Module, ids: list[int], version: int) -> None:
    """vLLM serves exactly ``model`` as ``version``: its greedy tokens and their logprobs
    equal transformers' (``bridge_checks.assert_serves`` with fewer tokens), and the label."""
    got_ids, got_lp, header = vllm_greedy(url, name, ids, N_TOKENS)
    assert_greedy(model, ids, got_ids, got_lp)
    assert header == str(version) == str(served_version(url))


@contextmanager
def frozen_at(phase: str, server: BridgeServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Arm the fault point: the bridge SIGSTOPs the server's processes just before ``phase``.
    On leaving, the server is continued (SIGCONT) whatever happened."""
    pids = [server.proc.pid, *(p.pid for p in descendants(server.proc.pid))]
    monkeypatch.setenv(FAULT_ENV, f"{phase}:{','.join(map(str, pids))}")
    reset_faults()
    try:
        yield
    finally:
        monkeypatch.delenv(FAULT_ENV)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def hang_then_recover(
    server: BridgeServer,
    phase: str,
    build: Callable[[SyncDeadlines], WeightBridge],
    model,
    ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
    *,
    warm: bool = False,
    served: Callable[[WeightBridge], str] | None = None,
) -> None:
    """One case (the module docstring's steps 1-4) for ``phase`` of the bridge ``build``
    makes. ``warm``: sync once first (a phase of a later sync only: the check before a
    network round); ``served``: the model name to ask (LoRA: the bridge's adapter)."""
    url = server.base_url
    version = served_version(url)
    bridge = build(SyncDeadlines(**{**OTHERS, "close": DEADLINE, phase: DEADLINE}))
    if warm:
        new_weights(model, version)
        version += 1
        bridge.sync(model, version)
    new_weights(model, version + 1)
    with frozen_at(phase, server, monkeypatch):
        with pytest.raises(SyncTimeout) as err:
            bridge.sync(model, version + 1)
        bridge.close()  # the trainer's `finally`, the server still frozen: bounded too
        time.sleep(DEADLINE)  # frozen for longer than the deadline, then continued
    e = err.value
    # the phase's own deadline fired (bounded() waits that long, then names the phase): no
    # wall-clock bound here, which a loaded box could break by chance
    assert (e.phase, e.server, e.deadline_s) == (phase, url, DEADLINE), str(e)
    assert f"weight sync to {url} timed out in phase '{phase}' after {DEADLINE:g} s" in str(e)
    # the next sync, from a fresh bridge with the default deadlines (a resumed trainer's)
    new_weights(model, version + 2)
    with build(SyncDeadlines()) as fresh:
        fresh.sync(model, version + 2)
        name = served(fresh) if served else server.served_model_name
    serves(url, name, model, ids, version + 2)


def _server(tiny_model_dir: Path, tmp_path: Path, mode: str, **kw) -> BridgeServer:
    return start_bridge_server(
        tiny_model_dir, mode, tmp_path / f"vllm-{mode}.log", token=TOKEN, forked=True, **kw
    )


def test_broadcast_phases(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``shared_vllm`` (gloo): the network path (``shm_fast_path=False``: what a receiver on
    another host gets), whose sync has every phase: the run_id check before a network round,
    the group's set-up, /bridge/stage, the broadcast, /bridge/apply."""
    server = _server(tiny_model_dir, tmp_path, "shared_vllm")
    try:
        model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)

        def build(d: SyncDeadlines) -> WeightBridge:
            return make_bridge(
                "shared_vllm", [server.base_url], token=TOKEN, shm_fast_path=False, deadlines=d
            )

        for phase in ("connect", "stage", "transfer", "apply", "check"):
            hang_then_recover(server, phase, build, model, ids, monkeypatch, warm=phase == "check")
    finally:
        server.stop()


def test_single_copy_phases(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``shared_vllm --single-copy`` (/dev/shm): the segment's set-up and /bridge/apply."""
    server = _server(tiny_model_dir, tmp_path, "shared_vllm", single_copy=True)
    try:
        model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)

        def build(d: SyncDeadlines) -> WeightBridge:
            return make_bridge(
                "shared_vllm", [server.base_url], single_copy=True, token=TOKEN, deadlines=d
            )

        for phase in ("connect", "apply"):
            hang_then_recover(server, phase, build, model, ids, monkeypatch)
    finally:
        server.stop()


def test_lora_phases(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``lora_only``: the run_id check and /bridge/lora/load."""
    from peft import LoraConfig, get_peft_model

    server = _server(tiny_model_dir, tmp_path, "lora_only")
    try:
        ids = prompt_ids(tiny_model_dir)
        model = get_peft_model(
            hf_model(tiny_model_dir), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        )

        def build(d: SyncDeadlines) -> WeightBridge:
            save = tmp_path / "adapters"
            return make_bridge(
                "lora_only", [server.base_url], token=TOKEN, save_dir=save, deadlines=d
            )

        for phase in ("check", "apply"):
            hang_then_recover(
                server, phase, build, model, ids, monkeypatch, served=lambda b: b.served_model
            )
    finally:
        server.stop()


def test_reload_phases(
    none_server: BridgeServer, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """``none``: the run_id check and /bridge/reload (the session's ``none`` server)."""
    from tests.integration.grpo_harness import TOKEN as NONE_TOKEN

    model, ids = hf_model(tiny_model_dir), prompt_ids(tiny_model_dir)

    def build(d: SyncDeadlines) -> WeightBridge:
        url = none_server.base_url
        return make_bridge("none", [url], token=NONE_TOKEN, save_dir=tmp_path / "ckpt", deadlines=d)

    for phase in ("check", "apply"):
        hang_then_recover(none_server, phase, build, model, ids, monkeypatch)


def test_a_frozen_server_stops_the_trainer_and_resume_continues(
    tiny_model_dir: Path, tmp_path: Path, none_server: BridgeServer
) -> None:
    """The trainer process: its first sync meets a frozen server in phase ``apply``. It
    stops with exit 75 and a ``STOPPED:`` line naming the phase, the server and the deadline
    (what the launcher quotes, launch/exits.py); the batch it trained is in its checkpoint and
    is the only one acked. The server is continued past the deadline; ``--resume``
    re-syncs the checkpoint's weights, trains the other batch, and every batch is acked
    exactly once: none lost, none trained twice."""
    from launch.procs import ManagedProcess
    from tests.integration.grpo_harness import GROUP, run_trainer, start_api
    from tests.integration.trainer.test_trainer_grpo import _groups

    api, client, api_url = start_api(tmp_path)
    url = none_server.base_url
    save = tmp_path / "run"
    pids = [none_server.proc.pid, *(p.pid for p in descendants(none_server.proc.pid))]
    try:
        client.register_env("shop_r1", 1.0, GROUP)
        assert client.push_groups(_groups(tiny_model_dir, 4, version=0)).accepted == 4
        argv = trainer_argv(tiny_model_dir, save, api_url, url)
        env = {**os.environ, FAULT_ENV: f"apply:{','.join(map(str, pids))}"}
        log = tmp_path / "trainer-frozen.log"
        proc = ManagedProcess("trainer", argv, log, env=env, forked=True).start()
        try:
            rc = proc.wait_exit()
            time.sleep(DEADLINE)  # the server stays frozen past the deadline
        finally:
            proc.stop()
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        text = log.read_text()
        assert rc == 75, text[-3000:]
        stop = f"STOPPED: weight sync to {url} timed out in phase 'apply' after {DEADLINE:g} s"
        assert stop in text, text[-3000:]
        state = json.loads(
            (save / "checkpoints" / "step_000001" / "trainer_state.json").read_text()
        )
        trained = [b["batch_id"] for b in state["recent_batches"]]
        assert state["step"] == 1 and len(trained) == 1
        status = client.status()
        assert status.acked_batches == 1, status  # the checkpointed one, nothing else
        # continued: the resumed trainer re-syncs step 1's weights, then trains step 2
        run_trainer(tiny_model_dir, save, api_url, url, 2, "--resume")
        status = client.status()
        assert status.acked_batches == 2 and status.queued_groups == 0, status
        rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [2], rows  # step 1 stopped before its log line
        assert served_version(url) == 2
    finally:
        client.close()
        api.stop()


def trainer_argv(model: Path, save: Path, api_url: str, vllm_url: str) -> list[str]:
    """``run_trainer``'s command (tests/integration/grpo_harness.py), 2 steps, with the
    ``apply`` deadline at ``DEADLINE``."""
    import sys

    from tests.integration.grpo_harness import GROUP
    from tests.integration.grpo_harness import TOKEN as API_TOKEN

    return [
        sys.executable,
        "-m",
        "trainer",
        "grpo",
        *("--model-name", str(model), "--save-path", str(save)),
        *("--api-url", api_url, "--api-token", API_TOKEN),
        *("--weight-bridge-mode", "none", "--inference-url", vllm_url),
        *("--bridge-token", API_TOKEN, "--training-steps", "2"),
        *("--batch-size", str(2 * GROUP), "--lr", "1e-3", "--wait-timeout", "60"),
        *("--poll-interval", "0.2", "--no-tensorboard", "--precision", "fp32"),
        *("--sync-deadline.apply", f"{DEADLINE:g}"),
    ]

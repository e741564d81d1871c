"""A multi-turn atroposlib env trains through this stack (issue 45 point 4): the user's
``GuessNumberEnv`` (atropos_multiturn_env.py: three model turns per conversation, the env
replying "higher" / "lower" between them, all through atroposlib's ``ManagedServer``), run by
atroposlib's own ``serve`` CLI, samples from our patched vLLM's ``/generate`` and posts to our
API; our GRPO trainer (tiny model, ``shared_vllm``) trains ``STEPS`` steps and syncs back.

Between the env and vLLM sits a recording proxy (in this process): it keeps every
``/generate`` exchange as vLLM answered it. Checked:
1. every sequence the env posted and the API acknowledged (and, byte for byte, the groups
   still queued at the end) has interleaved masks: exactly ``TURNS`` trained runs, the env's
   replies between them at ``-100``;
2. every trained run is what vLLM sampled for that turn: a ``/generate`` call whose prompt
   was exactly the sequence's tokens before the run (ManagedServer sends the node's own
   tokens, never a re-rendered chat), whose sampled tokens are the run and whose logprobs are
   the run's inference logprobs, float for float; the trainer's first step (the start
   weights, which sampled its batch) measures a logprob mismatch near zero on them, and every
   step trains as many tokens as its groups' runs hold;
3. the trainer trains ``STEPS`` steps on them and syncs each; later groups carry newer
   weight versions: the API's label, and vLLM's own in the ``/generate`` replies of every
   turn; ``/generate`` serves version ``STEPS`` at the end.

Made certain, not likely: the env's scores are spread by construction (ties broken by
rollout order), so every group is posted with non-zero advantages whatever the random tiny
model says. The versions follow from the order, not from timing: the trainer is paused
(SIGSTOP) before the env starts, the env paused once a batch of its groups is queued (all
sampled by the start weights), the trainer let go for its first step, and the env let go only
once the API has version 1; ``--max-staleness 0`` drops the version-0 groups left queued, so
batch ``k`` holds groups labelled ``k - 1``, and of the groups trained after the first step
at most ``WORKERS`` (the groups in flight at the pause: atroposlib runs no more) began
before version 1.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.atropos_convert import to_native
from api.atropos_wire import prepare
from api.protocol import ScoredGroup
from api.store_queue import Queue
from bench.api.servers import ensure_atropos
from launch.procs import ManagedProcess, tail
from launch.vllm_server import start_bridge_server
from settings.ports import free_port
from trainer.atropos_fields import refusal
from trainer.config import GrpoConfig
from vllm_patching.protocol import VERSION_HEADER

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent.resolve().parent
STEPS, GROUP, BATCH, TURNS = 2, 4, 8, 3
TOKEN = "multiturn-bridge-token"
OFFPOLICY, WORKERS = 1, 1  # atroposlib's max_batches_offpolicy and max_num_workers


class GenerateRecorder:
    """A reverse proxy in front of vLLM, served from a thread of the test process (it dies
    with it): forwards every request and keeps each ``/generate`` exchange -- the request
    body, vLLM's reply body and its ``x-weight-version`` header."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.calls = upstream, []
        self.port = free_port()
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",)}
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.request(
                request.method,
                self.upstream + request.url.path,
                content=body,
                headers={**headers, "content-type": "application/json"} if body else headers,
            )
        if request.url.path == "/generate" and r.status_code == 200:
            self.calls.append(
                {
                    "request": json.loads(body),
                    "response": r.json(),
                    "version": int(r.headers[VERSION_HEADER]),
                }
            )
        kept = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", VERSION_HEADER)}
        return Response(r.content, status_code=r.status_code, headers=kept)

    def __enter__(self) -> GenerateRecorder:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _config(tmp: Path, api_url: str, proxy_url: str, model: Path) -> Path:
    cfg = {
        "env": {
            "rollout_server_url": api_url,
            "tokenizer_name": str(model),
            "group_size": GROUP,
            "total_steps": 1000,  # runs until stopped; the trainer decides the steps
            "max_batches_offpolicy": OFFPOLICY,
            "max_token_length": 4,  # tokens per model turn
            "max_num_workers": WORKERS,
            "use_wandb": False,
            "wandb_name": "guess_number",
        },
        "openai": {
            "base_url": proxy_url + "/v1",
            "api_key": "x",  # atroposlib's client needs one; no --api-key here
            "model_name": "tiny",
            "tokenizer_name": str(model),
            "server_type": "vllm",
            "timeout": 600,
        },
    }
    path = tmp / "guess_number.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trainer_argv(model: Path, save: Path, api_url: str, vllm_url: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "trainer", "grpo", "--model-name", str(model), "--save-path", str(save)),
        *("--api-url", api_url, "--weight-bridge-mode", "shared_vllm"),
        *("--inference-url", vllm_url, "--bridge-token", TOKEN, "--device", "cpu"),
        *("--training-steps", str(STEPS), "--batch-size", str(BATCH), "--lr", "1e-3"),
        *("--kl-beta", "0", "--temperature", "1.0", "--lease-seconds", "600"),
        *("--wait-timeout", "900", "--poll-interval", "0.3", "--save-every", "1"),
        *("--no-tensorboard", "--precision", "fp32", "--rollout-samples", "0"),
    ]


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of a label mask's trained tokens (anything but -100)."""
    spans, start = [], None
    for i, m in enumerate([*mask, -100]):
        if m != -100 and start is None:
            start = i
        elif m == -100 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def sampled(call: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """A recorded ``/generate`` call (n=1): its prompt ids, sampled ids and their logprobs."""
    prompt = call["request"]["prompt"]["prompt_token_ids"]
    (positions,) = call["response"]["logprobs"]  # one completion
    ids = [int(next(iter(p[0]))) for p in positions]  # the sampled token first
    lps = [float(next(iter(p[0].values()))) for p in positions]
    assert ids == call["response"]["token_ids"][0]
    return prompt, ids, lps


def _wait_for(what: str, check, procs: list[ManagedProcess], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            assert p.alive(), f"{p.name} died while waiting for {what}:\n{tail(p.log_path)}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s"
        time.sleep(0.2)


def _db(db: Path, read):
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return read(conn)


def _queued(db: Path) -> int:
    sql = "SELECT count(*) FROM groups WHERE state='queued'"
    return _db(db, lambda c: c.execute(sql).fetchone()[0])


def test_multiturn_managed_server_env_trains_on_what_vllm_sampled(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    py_atropos = ensure_atropos()
    api_port = free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    db, save, record = tmp_path / "api.sqlite", tmp_path / "trainer", tmp_path / "posts.jsonl"
    procs: list[ManagedProcess] = []
    vllm = None
    try:
        api_argv = [sys.executable, "-m", "api", "--port", str(api_port), "--db-path", str(db)]
        api_argv += ["--max-staleness", "0"]  # a new version drops the older queued groups
        api = ManagedProcess("api", api_argv, tmp_path / "api.log", forked=True)
        procs.append(api.start())
        api.wait_http(api_url + "/health", timeout=300)
        vllm = start_bridge_server(
            tiny_model_dir,
            "shared_vllm",
            tmp_path / "vllm.log",
            token=TOKEN,
            timeout=1800,
            forked=True,
        )
        with GenerateRecorder(vllm.base_url) as proxy:
            argv = _trainer_argv(tiny_model_dir, save, api_url, vllm.base_url)
            trainer = ManagedProcess("trainer", argv, tmp_path / "trainer.log", forked=True)
            procs.append(trainer.start())
            # atroposlib envs wait for a trainer's first /batch request; then no batch, no lease
            _wait_for("the trainer's /batch request", lambda: _db(db, Queue.started), procs)
            os.kill(trainer.pid, signal.SIGSTOP)
            cfg = _config(tmp_path, api_url, proxy.base_url, tiny_model_dir)
            env = {**os.environ, "ATROPOS_RECORD": str(record), "HF_HUB_OFFLINE": "1"}
            script = str(HERE / "atropos_multiturn_recorded_env.py")
            argv = [str(py_atropos), script, "serve", "--config", str(cfg)]
            guess = ManagedProcess("guess_number", argv, tmp_path / "guess.log", env=env)
            procs.append(guess.start())
            try:
                _wait_for("a batch of groups", lambda: _queued(db) >= BATCH // GROUP, procs)
                os.kill(guess.pid, signal.SIGSTOP)  # every group so far: version 0
            finally:
                os.kill(trainer.pid, signal.SIGCONT)
            try:
                _wait_for("version 1", lambda: _db(db, Queue.live_version) >= 1, [trainer])
            finally:
                os.kill(guess.pid, signal.SIGCONT)
            assert trainer.wait_exit(stall=900, limit=1800) == 0, tail(trainer.log_path)
            assert guess.alive(), tail(guess.log_path)  # never crashed against our stack
            guess.stop()  # before the calls are read: every post's calls are among them
            calls = list(proxy.calls)
        with open(tmp_path / "generate.jsonl", "w") as f:  # for a failure's post-mortem
            f.writelines(json.dumps(c) + "\n" for c in calls)
        probe = httpx.post(
            f"{vllm.base_url}/generate",
            json={"prompt": {"prompt_token_ids": [5, 6]}, "max_tokens": 1},
            timeout=300,
        )
    finally:
        for p in reversed(procs):
            p.stop()
        if vllm is not None:
            vllm.stop()

    rows = _db(
        db,
        lambda c: c.execute(
            "SELECT group_id, state, batch_id, policy_version, payload FROM groups ORDER BY seq"
        ).fetchall(),
    )
    by_id = {r[0]: r for r in rows}
    posts = [json.loads(x) for x in record.read_text().splitlines()]
    acked = {p["group_id"]: p for p in posts if p["event"] == "acked"}
    assert acked and set(acked) <= set(by_id), "a group the API acknowledged is missing"
    metrics = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))
    final = sorted((save / "checkpoints").glob("step_*"))[-1]
    batches = json.loads((final / "trainer_state.json").read_text())["recent_batches"]
    assert [b["batch_id"] for b in batches] == [m["batch_id"] for m in metrics]
    trained = [g for b in batches for g in b["group_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * BATCH // GROUP
    assert {r[0] for r in rows if r[1] == "acked"} == set(trained) <= set(acked)
    assert {r[1] for r in rows} <= {"acked", "queued", "dropped"}  # none skipped or refused

    # 1. what the API stores: interleaved masks, TURNS trained runs per sequence; the groups
    # still queued are stored byte for byte as posted (acked ones' payloads are cleared)
    fields = ("tokens", "masks", "inference_logprobs", "scores")
    for gid, post in acked.items():
        if by_id[gid][1] == "queued":
            stored = json.loads(by_id[gid][4])
            assert {k: stored[k] for k in fields} == {k: post[k] for k in fields}
        for toks, mask, lps in zip(*(post[k] for k in fields[:3]), strict=True):
            assert len(toks) == len(mask) == len(lps)
            spans = runs(mask)
            assert len(spans) == TURNS, (gid, mask)  # assistant / env / assistant / env / ...
            assert spans[-1][1] == len(toks)  # it ends with the last turn's sample

    # 2. each trained run is one /generate call's sample: its prompt the tokens before the
    # run, its tokens the run, its logprobs the run's, exactly; what a native lease makes of
    # it (api/atropos_convert.py) trains those runs
    versions: dict[str, list[list[list[int]]]] = {}  # group -> sequence -> turn -> calls
    for gid, post in acked.items():
        for toks, mask, lps in zip(*(post[k] for k in fields[:3]), strict=True):
            turns = []
            for a, b in runs(mask):
                assert mask[a:b] == toks[a:b]  # labels are the tokens themselves
                want = (toks[:a], toks[a:b], lps[a:b])
                match = [c["version"] for c in calls if sampled(c) == want]
                assert match, f"group {gid}: run {a}:{b} is no /generate sample"
                turns.append(match)  # the versions of the calls that sampled exactly this
            versions.setdefault(gid, []).append(turns)
            assert all(x == 1.0 for x, m in zip(lps, mask, strict=True) if m == -100)
        native = json.loads(to_native(json.dumps({k: post[k] for k in fields}), gid, "e", 0))
        assert refusal(ScoredGroup.model_validate(native), GrpoConfig(temperature=1.0)) is None
        for seq, toks, mask in zip(native["sequences"], post["tokens"], post["masks"], strict=True):
            assert seq["mask"] == [int(m != -100) for m in mask] and seq["tokens"] == toks

    # the trainer's first step: the start weights sampled its batch, so the trainer's own
    # logprobs of the trained tokens match vLLM's (a token off by one would be nats away)
    assert metrics[0]["logprob_mismatch"] < 1e-2, metrics[0]["logprob_mismatch"]
    for step, b in zip(metrics, batches, strict=True):
        assert step["advantage_abs_mean"] > 0  # the spread by construction
        masks = [mask for g in b["group_ids"] for mask in acked[g]["masks"]]
        n_trained = sum(x != -100 for mask in masks for x in mask)
        assert step["tokens"] == n_trained, (step["tokens"], n_trained)

    # 3. later groups carry newer weight versions: batch k holds groups the API labelled
    # k - 1 (--max-staleness 0); every turn of batch 1 was sampled by version 0, and after
    # it all but the WORKERS groups in flight at the env's pause by version >= 1
    stamped = [r[3] for r in rows]
    assert stamped == sorted(stamped)  # arrival order
    for k, b in enumerate(batches):
        assert {by_id[g][3] for g in b["group_ids"]} == {k}, (k, b)
    assert all(m["staleness_mean"] == 0 for m in metrics)

    def calls_of(g: str) -> list[int]:
        return [v for seq in versions[g] for turn in seq for v in turn]

    first = [v for g in batches[0]["group_ids"] for v in calls_of(g)]
    assert set(first) == {0}, first
    later = [g for b in batches[1:] for g in b["group_ids"]]
    fresh = [g for g in later if min(calls_of(g)) >= 1]
    assert len(fresh) >= len(later) - WORKERS > 0, {g: versions[g] for g in later}
    assert probe.status_code == 200 and probe.headers[VERSION_HEADER] == str(STEPS)


def test_managed_server_keeps_each_turns_sampled_tokens_and_what_breaks_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """atroposlib 0.4.0's ManagedServer, multi-turn, against a stub server
    (atropos_managed_probe.py): when each turn's chat rendering starts with the previous
    node's text it extends that node -- the earlier tokens as sampled, only the new text
    tokenized, and those tokens are the next prompt sent -- so one node holds every turn (not
    what re-tokenizing the chat gives). When the rendering changes earlier text (a template
    that trims), it starts a fresh node from the whole chat tokenized again, all of it
    masked: the earlier turns are no longer trained, and the old nodes stay beside it (the
    node is still aligned: our API cannot tell, the env has to count nodes). A server that
    answers too few logprobs leaves ManagedServer's 1.0 on a trained token: our trainer refuses
    that group at lease time, naming the position (trainer/atropos_fields.py)."""
    out = tmp_path / "probe.json"
    script = str(HERE / "atropos_managed_probe.py")
    subprocess.run(
        [str(ensure_atropos()), script, str(tiny_model_dir), str(out)], check=True, timeout=600
    )
    res = json.loads(out.read_text())

    def refused(node: dict[str, Any]) -> str | None:
        """What the trainer says of a group of this node, stored and leased by the API."""
        posted = {
            "tokens": [node["tokens"]],
            "masks": [node["masked_tokens"]],
            "scores": [1.0],
            "inference_logprobs": [node["logprobs"]],
        }
        payload = prepare(posted, "reject").payload
        group = ScoredGroup.model_validate_json(to_native(payload, "g", "guess", 0))
        return refusal(group, GrpoConfig(temperature=1.0))

    whole = res["append_only"]
    (node,) = whole["nodes"]
    spans = runs(node["masked_tokens"])
    assert len(spans) == TURNS
    for (a, b), prompt in zip(spans, whole["prompts"], strict=True):
        assert node["tokens"][a:b] == whole["sampled"] and prompt == node["tokens"][:a]
        assert node["logprobs"][a:b] == [-0.5] * (b - a)
    assert node["tokens"] != whole["retokenized"]  # the chat tokenized again differs
    assert refused(node) is None  # aligned: trained

    trimmed = res["trimmed"]
    assert len(trimmed["nodes"]) == TURNS  # a fresh node per turn
    last = trimmed["nodes"][-1]
    ((a, b),) = runs(last["masked_tokens"])  # only the last turn is trained
    assert last["tokens"][:a] == trimmed["prompts"][-1]  # the prompt vLLM was sent
    assert last["tokens"][:a] != node["tokens"][: spans[-1][0]]  # earlier turns re-tokenized
    assert refused(last) is None  # still aligned: the env must notice

    (short,) = res["short_logprobs"]["nodes"]
    end = runs(short["masked_tokens"])[0][1] - 1
    assert short["logprobs"][end] == 1.0
    assert refused(short).startswith(f"inference_logprobs[0][{end}] = 1 at a trained")

"""Scored-group construction, completion-response parsing, evaluation metrics, service config."""

from __future__ import annotations

import json

import pytest

from env_server.config import parse_config
from env_server.data.corpus import iter_corpus_texts
from env_server.data.dataset import build_dataset
from env_server.eval_stats import compute_metrics, format_table, oracle_exact_match
from env_server.inference import Completion, CompletionBatch, parse_completion_response
from env_server.prompts import format_target
from env_server.reward import RewardConfig
from env_server.rollout import build_group, prompt_ids, rationale_mask

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.tiny_model import train_tokenizer

    return train_tokenizer(iter_corpus_texts(num_sessions=40, seed=0), 2048)


@pytest.fixture(scope="module")
def rows():
    return build_dataset(num_sessions=40, seed=0)["train"].to_list()


def test_rationale_mask_marks_exactly_the_rationale_tokens(tokenizer, rows) -> None:
    row = rows[3]
    text = format_target('I\'ll café-hop "later" ✓ ' + row["rationale"], json.loads(row["action"]))
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    mask = rationale_mask(tokenizer, ids)
    assert len(mask) == len(ids) and mask[-1] == 0  # EOS carries no rationale
    marked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    content = json.dumps(json.loads(text)["rationale"], ensure_ascii=False)[1:-1]
    # Boundary tokens may also hold the opening/closing quote; nothing else is marked.
    assert content in marked and len(marked) <= len(content) + 4
    assert "action" not in marked


def test_garbage_completion_has_no_rationale_tokens(tokenizer) -> None:
    ids = tokenizer.encode('{"rationale": "unfinished', add_special_tokens=False)
    assert rationale_mask(tokenizer, ids) == [0] * len(ids)


def test_build_group_follows_the_data_contract(tokenizer, rows) -> None:
    row = rows[5]
    gold = json.loads(row["action"])
    prompt = prompt_ids(row, tokenizer, max_prompt_tokens=512, latest_only=False)
    assert len(prompt) <= 512
    good = tokenizer.encode(format_target(row["rationale"], gold), add_special_tokens=False)
    bad = tokenizer.encode("I think I'd click something", add_special_tokens=False)
    batch = CompletionBatch(
        prompt_ids=prompt,
        completions=[
            Completion(tokenizer.decode(good), good, [-0.5] * len(good), "stop"),
            Completion(tokenizer.decode(bad), bad, [-2.0] * len(bad), "length"),
        ],
        weight_version=3,
    )
    g = build_group(row, batch, tokenizer, RewardConfig(), policy_version=3)
    assert g["env"] == "shop_r1" and g["policy_version"] == 3 and len(g["group_id"]) == 36
    s0, s1 = g["sequences"]
    for s, comp in ((s0, good), (s1, bad)):
        n = len(prompt) + len(comp)
        assert len(s["tokens"]) == len(s["mask"]) == len(s["logprobs"]) == n
        assert len(s["spans"]["rationale"]) == n
        assert s["tokens"][: len(prompt)] == prompt and s["tokens"][len(prompt) :] == comp
        assert s["mask"] == [0] * len(prompt) + [1] * len(comp)
        assert s["logprobs"][: len(prompt)] == [0.0] * len(prompt)
        assert not any(s["spans"]["rationale"][: len(prompt)])
    assert s0["score"] >= 0.8 and s1["score"] == 0.0
    assert any(s0["spans"]["rationale"]) and not any(s1["spans"]["rationale"])
    assert g["metrics"]["valid"] == 0.5 and g["metrics"]["truncated"] == 0.5
    json.dumps(g)  # wire-ready


def test_score_ramp_spreads_a_group_that_scores_all_alike(tokenizer, rows) -> None:
    """``EnvConfig.score_ramp`` (a test's GRPO signal by construction): completions that all
    score 0 get 0, r, 2r, ...; the rollout records' terms still sum to each score."""
    row = rows[5]
    bad = tokenizer.encode("I think I'd click something", add_special_tokens=False)
    comp = Completion(tokenizer.decode(bad), bad, [-2.0] * len(bad), "length")
    batch = CompletionBatch(prompt_ids=[1, 2, 3], completions=[comp] * 4, weight_version=0)
    plain = build_group(row, batch, tokenizer, RewardConfig(), policy_version=0)
    assert [s["score"] for s in plain["sequences"]] == [0.0] * 4
    assert all("score_ramp" not in r["reward"] for r in plain["extras"]["rollouts"])
    g = build_group(row, batch, tokenizer, RewardConfig(), policy_version=0, score_ramp=0.5)
    assert [s["score"] for s in g["sequences"]] == [0.0, 0.5, 1.0, 1.5]
    for s, r in zip(g["sequences"], g["extras"]["rollouts"], strict=True):
        assert sum(r["reward"].values()) == pytest.approx(s["score"])
    assert g["metrics"] == plain["metrics"]  # the reward's own statistics, unchanged


def test_parse_completion_response_aligns_and_checks() -> None:
    body = {
        "choices": [
            {
                "index": 1,
                "text": "b",
                "token_ids": [5, 6],
                "finish_reason": "stop",
                "logprobs": {"token_logprobs": [-0.1, float("-inf")]},
            },
            {
                "index": 0,
                "text": "a",
                "token_ids": [7],
                "finish_reason": "length",
                "logprobs": {"token_logprobs": [-1.5]},
            },
        ]
    }
    b = parse_completion_response(body, [1, 2], "4")
    assert b.weight_version == 4 and [c.text for c in b.completions] == ["a", "b"]
    assert b.completions[1].logprobs == [-0.1, -1e4]  # -inf clamped: JSON has no infinity
    assert parse_completion_response(body, [1], None).weight_version is None
    body["choices"][0]["token_ids"] = [5]
    with pytest.raises(ValueError, match="logprobs"):
        parse_completion_response(body, [1], None)


def test_metrics_hand_computed() -> None:
    golds = [
        {"type": "click", "name": "a"},
        {"type": "click", "name": "b"},
        {"type": "type_and_submit", "name": "s", "text": "x"},
        {"type": "terminate"},
    ]
    outs = [
        format_target("r", {"type": "click", "name": "a"}),  # exact
        format_target("r", {"type": "click", "name": "z"}),  # type right, name wrong
        format_target("r", {"type": "terminate"}),  # wrong type
        "not json",  # invalid
    ]
    m = compute_metrics(golds, outs)
    assert m["exact_match"] == pytest.approx(1 / 4)
    assert m["type_accuracy"] == pytest.approx(2 / 4)
    assert m["format_rate"] == pytest.approx(3 / 4)
    # click: P = 2/2, R = 2/2 -> F1 1; type_and_submit: F1 0; terminate: P 0/1 -> F1 0
    assert m["per_type"]["click"]["f1"] == pytest.approx(1.0)
    assert m["per_type"]["terminate"]["precision"] == 0.0
    assert m["macro_f1"] == pytest.approx(1 / 3)
    assert m["per_type"]["click"]["exact_match"] == pytest.approx(0.5)
    assert m["confusion"]["matrix"]["terminate"]["invalid"] == 1
    assert "macro-F1 33.33%" in format_table(m)
    assert oracle_exact_match(['[["a", 0.6], ["b", 0.4]]', '[["c", 1.0]]']) == pytest.approx(0.8)
    assert oracle_exact_match(["[]"]) is None


def test_service_config_from_yaml_and_flags(tmp_path) -> None:
    recipe = tmp_path / "env.yaml"
    recipe.write_text("env:\n  group_size: 4\n  reward:\n    dars_factor: 10\n  model: tiny\n")
    cfg = parse_config(["--config", str(recipe), "--group-size", "6", "--no-drop-constant-groups"])
    assert cfg.group_size == 6 and not cfg.drop_constant_groups and cfg.model == "tiny"
    assert cfg.reward_config().dars_factor == 10
    assert parse_config(["--reward-variant", "binary"]).reward_config().mode == "binary"
    with pytest.raises(SystemExit, match="group_size"):
        parse_config(["--group-size", "1"])


def test_inference_client_retries_a_dead_server_then_gives_up() -> None:
    import asyncio
    import time

    import httpx

    from api.retry import is_transient
    from env_server.inference import InferenceClient
    from settings.ports import free_port

    client = InferenceClient(f"http://127.0.0.1:{free_port()}", "tiny", max_attempts=3)

    async def go() -> None:
        try:
            await client.complete([1, 2, 3], n=2, max_tokens=4)
        finally:
            await client.aclose()

    t = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        asyncio.run(go())
    assert time.monotonic() - t >= 0.5 * 0.8 + 1.0 * 0.8  # two backoffs: 0.5 s, 1 s (+ jitter)
    request = httpx.Request("POST", "http://x")
    assert is_transient(httpx.HTTPStatusError("", request=request, response=httpx.Response(503)))
    assert not is_transient(
        httpx.HTTPStatusError("", request=request, response=httpx.Response(400))
    )
    assert not is_transient(ValueError("bad"))


def test_wait_ready_waits_through_a_server_that_is_not_up_yet() -> None:
    """``evaluate --wait-for-server``: 503s (a server still loading) are waited through until
    /health answers 200; a port nobody listens on is a TimeoutError once the time is up."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from env_server.inference import wait_ready
    from settings.ports import free_port

    asked: list[str] = []

    class Loading(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            self.send_response(200 if len(asked) > 2 else 503)
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        asyncio.run(wait_ready(f"http://127.0.0.1:{server.server_port}/", 60))
    finally:
        server.shutdown()
        server.server_close()
    assert asked == ["/health"] * 3
    with pytest.raises(TimeoutError, match="did not answer /health within 1 s"):
        asyncio.run(wait_ready(f"http://127.0.0.1:{free_port()}", 1))

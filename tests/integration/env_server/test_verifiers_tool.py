"""A verifiers env whose model calls a Python tool trains through the stack (issue 45).

``vf_tool`` (tests/integration/verifiers_envs) is written with verifiers' public API: a
``vf.Toolset`` serving ``add(a, b)`` over MCP (verifiers starts it as a local subprocess)
and verifiers' ``null`` harness, whose chat loop executes the model's tool calls. The
model is :func:`build_tool_model`: the embedded tiny model with the Hermes/Qwen call
markers ``<tool_call>``/``</tool_call>`` added to its tokenizer (renderers 0.1.12's
``qwen3`` tool parser finds a call by those token ids only), a chat template that renders
tools, tool calls and tool results, and an output head fitted so that, greedily, it calls
the tool on the task's prompt and answers with the tool's result after it. So the call is
certain, not left to a random model; everything after it is the real stack: vLLM samples
it, verifiers' renderer parses it, the MCP server computes the sum, verifiers renders the
result as a tool turn, vLLM samples the answer.

Checked: the group arrives; each sequence is [prompt][the call, mask 1][the tool result
and the next prompt, mask 0][the answer, mask 1]; every mask-1 run is exactly what vLLM
returned for the tokens before it (the proxy's record), logprobs aligned; the first
prompt is the one the head was fitted on; the trainer trains a step on the group.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from launch.procs import ManagedProcess, tail
from launch.vllm_server import start_bridge_server
from settings.ports import free_port
from tests.integration.env_server.test_verifiers_env import ENVS, HERE, _check_exact, _queued

pytestmark = pytest.mark.integration
TOKEN = "vf-tool-token"
GROUP = 2
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# Qwen2.5's tool template, shortened: tools in the system turn, a call as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, a result as a user turn.
TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# What verifiers sends for vf_tool's task: the MCP tool (mcp 2.0.0's schema of
# ``add(a: int, b: int)``, named ``<server>_<tool>`` by the chat program) and the prompt.
A, B = 2, 3
SCHEMA = {  # in the order it reaches the renderer
    "type": "object",
    "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
    "required": ["a", "b"],
    "title": "addArguments",
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "calc_add", "description": "Add two integers.", "parameters": SCHEMA},
    }
]
CONVERSATION = [
    {"role": "user", "content": f"What is {A} + {B}? Use the tool."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calc_add", "arguments": {"a": A, "b": B}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": str(A + B)},
    {"role": "assistant", "content": str(A + B)},
]


def build_tool_model(src: Path, out: Path, margin: float = 10.0) -> dict[str, list[int]]:
    """The tiny model at ``src`` with the call markers as added tokens, the tool template,
    and an untied output head fitted (closed form) so that on the conversation's two model
    turns, teacher-forced, each target token wins by ``margin`` logits: greedy decoding
    then reproduces them exactly. Returns the turns' prompt and completion ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens(TOOL_TOKENS)
    tok.chat_template = TOOL_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.resize_token_embeddings(len(tok), mean_resizing=False)

    def render(messages: list[dict], gen: bool) -> list[int]:
        return list(
            tok.apply_chat_template(
                messages, tools=TOOLS, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
        )

    end = tok.convert_tokens_to_ids("<|im_end|>")
    p1, p2, full = (
        render(CONVERSATION[:1], True),
        render(CONVERSATION[:3], True),
        render(CONVERSATION, False),
    )
    assert p2[: len(p1)] == p1 and full[: len(p2)] == p2, "the template is not prefix-stable"
    c1 = p2[len(p1) : p2.index(end, len(p1)) + 1]
    c2 = full[len(p2) : full.index(end, len(p2)) + 1]
    ids = torch.tensor([full[: len(p2) + len(c2)]])
    pos = torch.tensor([*range(len(p1), len(p1) + len(c1)), *range(len(p2), len(p2) + len(c2))])
    target = ids[0, pos]
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[0, pos - 1]  # the states that predict them
        w0 = model.get_input_embeddings().weight.detach().clone()
        logits = h @ w0.T
        # dual basis: h_i . g_k = delta_ik, so adding alpha_i g_i to row target_i raises
        # exactly that logit at exactly that position
        dual = torch.linalg.pinv(h).T
        alpha = logits.max(-1).values - logits.gather(1, target[:, None])[:, 0] + margin
        head = w0.index_add(0, target, alpha[:, None] * dual)
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
        check = model(ids).logits[0, pos - 1]
        assert (check.argmax(-1) == target).all()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"  # the verifiers venv loads it as the tiny one
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=TOOL_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return {"p1": p1, "c1": c1, "p2": p2, "c2": c2}


def test_verifiers_tool_call_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-tool"
    turns = build_tool_model(tiny_model_dir, model_dir)
    api_port = free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    db = tmp_path / "api.sqlite"
    procs: list[ManagedProcess] = []
    vllm = None
    try:
        api_argv = [sys.executable, "-m", "api", "--port", str(api_port), "--db-path", str(db)]
        procs.append(ManagedProcess("api", api_argv, tmp_path / "api.log", forked=True).start())
        procs[-1].wait_http(api_url + "/health", timeout=300)
        vllm = start_bridge_server(
            model_dir,
            "shared_vllm",
            tmp_path / "vllm.log",
            token=TOKEN,
            timeout=1800,
            forked=True,
            extra=["--enable-scale-out"],
        )
        env_argv = [
            *(sys.executable, "-m", "env_server.verifiers", "vf_tool", "--env-name", "tool"),
            *("--api-url", api_url, "--inference-url", vllm.base_url),
            *("--group-size", str(GROUP), "--max-groups", "1", "--concurrency", "1"),
            *("--max-tokens", "48", "--temperature", "0.0"),
            *("--renderer", json.dumps({"name": "default", "tool_parser": "qwen3"})),
            *("--record-path", str(tmp_path / "tool.record.jsonl")),
            *("--summary-path", str(tmp_path / "tool.summary.json"), "--poll-interval-s", "0.3"),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ENVS), str(HERE.parents[1])])}
        proc = ManagedProcess("tool", env_argv, tmp_path / "tool.log", env=env).start()
        procs.append(proc)
        assert proc.wait_exit(stall=900, limit=1800) == 0, tail(proc.log_path)
        summary = json.loads((tmp_path / "tool.summary.json").read_text())
        assert summary["pushed"] == 1, summary
        assert not any(k.startswith(("refused", "failed")) for k in summary), summary

        record = [json.loads(x) for x in (tmp_path / "tool.record.jsonl").read_text().splitlines()]
        assert {
            tuple(r["prompt_ids"]) for r in record if len(r["prompt_ids"]) == len(turns["p1"])
        } == {tuple(turns["p1"])}, (
            "verifiers rendered another first prompt than the head was fitted on"
        )
        ((version, group),) = _queued(db, "tool")
        assert version == 0 and len(group["sequences"]) == GROUP
        for seq, runs in zip(group["sequences"], _check_exact(group, record), strict=True):
            tokens = seq["tokens"]
            assert len(runs) == 2, runs  # the call, then the answer
            (a1, b1), (a2, b2) = runs
            assert tokens[:a1] == turns["p1"] and tokens[a1:b1] == turns["c1"]
            # between them, not sampled: the tool's result as verifiers rendered it
            assert tokens[:a2] == turns["p2"] and tokens[a2:b2] == turns["c2"]
            assert seq["score"] == 1.0

        save = tmp_path / "trainer"
        trainer_argv = [
            *(sys.executable, "-m", "trainer", "grpo", "--model-name", str(model_dir)),
            *("--save-path", str(save), "--api-url", api_url, "--device", "cpu"),
            *("--weight-bridge-mode", "shared_vllm", "--inference-url", vllm.base_url),
            *("--bridge-token", TOKEN, "--training-steps", "1", "--batch-size", str(GROUP)),
            *("--lr", "1e-3", "--kl-beta", "0.0"),
            *("--wait-timeout", "1800", "--poll-interval", "0.3", "--save-every", "1"),
            *("--no-tensorboard", "--precision", "fp32", "--rollout-samples", "0"),
        ]
        trainer = ManagedProcess("trainer", trainer_argv, tmp_path / "trainer.log", forked=True)
        procs.append(trainer.start())
        assert trainer.wait_exit(stall=900, limit=1800) == 0, tail(trainer.log_path)
    finally:
        for p in reversed(procs):
            p.stop()
        if vllm is not None:
            vllm.stop()
    metrics = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if not m.get("skipped_update")]) == 1, metrics
    with sqlite3.connect(db) as conn:
        states = [s for (s,) in conn.execute("SELECT state FROM groups WHERE env = 'tool'")]
    assert states == ["acked"], states

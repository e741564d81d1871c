"""What atroposlib 0.4.0's ``ManagedServer`` keeps for a multi-turn chat, against a stub
server (no vLLM): run in the atroposlib virtualenv as
``python atropos_managed_probe.py TOKENIZER_DIR OUT.json``; test_atropos_multiturn.py reads it.

Three conversations of three model turns (``chat_completion`` each turn, the conversation
extended with the answer and a user reply), the stub answering fixed tokens with logprob -0.5:
- ``append_only``: the tokenizer's own chat template (each turn's rendering starts with the
  previous one's text);
- ``trimmed``: a template that re-renders earlier assistant turns trimmed, so a turn's
  rendering does not start with the previous node's text;
- ``short_logprobs``: the server answering one logprob fewer than tokens.
For each: every node (tokens, masked_tokens, logprobs) and every prompt sent (input_ids).
"""

import asyncio
import json
import sys
from types import SimpleNamespace

from atroposlib.envs.server_handling.managed_server import ManagedServer
from transformers import AutoTokenizer

TRIMMED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] | trim)"
    " + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class StubServer:
    """Answers every prompt with the same tokens (`` 5 `` then `` ok``), logprob -0.5 each."""

    config = SimpleNamespace(model_name="stub")

    def __init__(self, tokenizer, short: bool) -> None:
        self.out = tokenizer.encode(" 5  ok ", add_special_tokens=False)
        self.short, self.prompts = short, []

    async def tokens_and_logprobs_completion(self, **kw):
        self.prompts.append(list(kw["input_ids"]))
        lps = [-0.5] * (len(self.out) - self.short)
        return kw["input_ids"], [list(self.out)], [lps], ["length"]


async def play(tokenizer, short: bool = False) -> dict:
    server = StubServer(tokenizer, short)
    managed = ManagedServer(server, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "Guess a digit."}]
    for turn in range(3):
        reply = await managed.chat_completion(messages=messages, n=1, max_tokens=4)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if turn < 2:
            messages.append({"role": "user", "content": "Higher."})
    nodes = managed.get_state()["nodes"]
    return {
        "nodes": [
            {"tokens": n.tokens, "masked_tokens": n.masked_tokens, "logprobs": n.logprobs}
            for n in nodes
        ],
        "prompts": server.prompts,
        "sampled": server.out,
        "retokenized": list(tokenizer.apply_chat_template(messages, tokenize=True)),
    }


async def main(model: str, out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    result = {"append_only": await play(tokenizer)}
    result["short_logprobs"] = await play(tokenizer, short=True)
    tokenizer.chat_template = TRIMMED
    result["trimmed"] = await play(tokenizer)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

"""A toy atroposlib ``BaseEnv`` and the small OpenAI-compatible server it samples from.

Runs in the atroposlib virtualenv (``bench/api/servers.py``'s ``ensure_atropos``),
never in the project's; ``tests/integration/api/test_atropos_compat.py`` starts it three ways:

    python atropos_toy_env.py make-tokenizer DIR      # a word-level tokenizer for BaseEnv
    python atropos_toy_env.py openai-server PORT      # /v1/completions, /v1/chat/completions
    python atropos_toy_env.py serve --config env.yaml # atroposlib's own `serve` CLI

The env is an ordinary ``BaseEnv`` subclass: it asks the server for ``group_size``
completions of a prompt, scores them, and lets atroposlib post the group (its own
``handle_send_to_api`` / ``_send_scored_data_to_api``). The only addition records, in
``$TOY_RECORD_DIR``, every group just before it is posted (``intent``) and after the API
answered 2xx (``acked``), so the test can check what the trainer was served against them
(atropos_post_recorder.py).
"""

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

VOCAB = ["[UNK]", "[EOS]"] + [f"w{i}" for i in range(512)]


def make_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(out)


def openai_server(port: int) -> None:
    """Deterministic completions: choice ``i`` of a prompt is ``n_words`` words from a
    generator seeded by the prompt and ``i``; one logprob per word (word-level tokens)."""
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()

    def choice_words(prompt: str, i: int, n_words: int) -> list[str]:
        rng = random.Random(f"{prompt}|{i}")
        return [f"w{rng.randrange(512)}" for _ in range(n_words)]

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        prompt, n = str(body["prompt"]), int(body.get("n") or 1)
        words = [choice_words(prompt, i, int(body.get("max_tokens") or 8)) for i in range(n)]
        choices = [
            {
                "index": i,
                "text": " " + " ".join(w),
                "finish_reason": "length",
                "logprobs": {
                    "tokens": w,
                    "token_logprobs": [-0.25 - 0.01 * k for k in range(len(w))],
                    "top_logprobs": None,
                    "text_offset": list(range(len(w))),
                },
            }
            for i, w in enumerate(words)
        ]
        return {
            "id": "cmpl-toy",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "toy"),
            "choices": choices,
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        n = int(body.get("n") or 1)
        choices = [
            {
                "index": i,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": "w1"},
            }
            for i in range(n)
        ]
        return {
            "id": "chat-toy",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "toy"),
            "choices": choices,
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def env_main() -> None:
    from atropos_post_recorder import PostRecorder
    from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig

    record_dir = Path(os.environ["TOY_RECORD_DIR"])

    class ToyEnv(PostRecorder, BaseEnv):
        name = "toy"

        @classmethod
        def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
            env = BaseEnvConfig(use_wandb=False, steps_per_eval=10**9, group_size=4)
            return env, [APIServerConfig(model_name="toy", base_url="", api_key="x")]

        async def setup(self) -> None:
            self.counter = 0

        async def get_next_item(self) -> str:
            self.counter += 1
            return f"w{os.getpid() % 512} w{self.counter % 512} w{self.counter // 512 % 512}"

        async def collect_trajectories(self, item: str) -> tuple[dict, list]:
            n = self.config.group_size
            out = await self.server.completion(prompt=item, n=n, max_tokens=6, logprobs=1)
            prompt = self.tokenizer.encode(item, add_special_tokens=False)
            tokens, masks, logprobs, scores, distill_ids, distill_lps = [], [], [], [], [], []
            for k, choice in enumerate(out.choices):
                completion = self.tokenizer.encode(choice.text, add_special_tokens=False)
                tokens.append(prompt + completion)
                masks.append([-100] * len(prompt) + completion)
                logprobs.append([0.0] * len(prompt) + list(choice.logprobs.token_logprobs))
                scores.append(float(sum(completion) % 97) + k / 10)  # never all equal
                distill_ids.append([[t, t + 1] for t in prompt + completion])
                distill_lps.append([[-0.5, -1.5] for _ in prompt + completion])
            group = {
                "tokens": tokens,
                "masks": masks,
                "scores": scores,
                "inference_logprobs": logprobs,
                "distill_token_ids": distill_ids,
                "distill_logprobs": distill_lps,
                "group_overrides": {"toy_uid": f"{os.getpid()}-{self.counter}-{item}"},
            }
            return group, []

        async def evaluate(self, *args: Any, **kwargs: Any) -> None:
            return None

        def record_path(self) -> str:
            return str(record_dir / f"env-{os.getpid()}.jsonl")

        def record_entry(self, group: dict[str, Any]) -> dict[str, Any]:
            return {"group": group}

    ToyEnv.cli()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "make-tokenizer":
        make_tokenizer(sys.argv[2])
    elif command == "openai-server":
        openai_server(int(sys.argv[2]))
    else:
        env_main()

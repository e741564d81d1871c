"""atroposlib 0.4.0's own ``server_type="vllm"`` client against a server's ``/generate``.

    python atropos_generate_client.py BASE_URL TOKENIZER_DIR API_KEY OUT_JSON

Runs in the atroposlib virtualenv (``bench.api.servers.ensure_atropos``), never
in the project's. Builds a ``ServerManager`` from an ``APIServerConfig(server_type="vllm")``
as a ``BaseEnv`` does, and records what atroposlib's code returns for: a text prompt with
``n`` samples (``tokens_and_logprobs_completion``), a token-id prompt (``input_ids``),
greedy sampling, prompt logprobs (``get_logprobs``), a ``ManagedServer`` completion (the
tracked nodes: tokens, masks, logprobs), and the same request with a wrong API key (its
``_tokens_and_logprobs_completion_wrapper`` raises on the 401).
"""

import asyncio
import json
import sys


async def main(base_url: str, tokenizer_dir: str, api_key: str, out: str) -> None:
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager
    from atroposlib.envs.server_handling.vllm_server import VLLMServer
    from transformers import AutoTokenizer

    def config(key: str) -> APIServerConfig:
        return APIServerConfig(
            model_name="tiny",
            base_url=base_url + "/v1",
            api_key=key,
            tokenizer_name=tokenizer_dir,
            server_type="vllm",
            timeout=300,
        )

    manager = ServerManager([config(api_key)])
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = "search for running shoes"
    res: dict = {}
    p, toks, lps, fins = await manager.tokens_and_logprobs_completion(
        prompt=prompt, n=3, max_tokens=6, temperature=1.0, top_p=1.0, seed=11
    )
    res["sampled"] = {"prompt": p, "tokens": toks, "logprobs": lps, "finish": fins}
    ids = tok.encode("click add to cart", add_special_tokens=False)
    p, toks, lps, fins = await manager.tokens_and_logprobs_completion(
        input_ids=ids, n=1, max_tokens=5, temperature=0.0
    )
    res["greedy_ids"] = {"prompt": p, "tokens": toks, "logprobs": lps, "finish": fins}
    res["prompt_logprobs"] = await manager.get_logprobs(input_ids=ids, top_k=3)
    async with manager.managed_server(tokenizer=tok) as managed:
        await managed.completion(prompt=prompt, n=2, max_tokens=4, temperature=1.0)
        nodes = managed.get_state()["nodes"]
    res["managed"] = [
        {"tokens": n.tokens, "masked_tokens": n.masked_tokens, "logprobs": n.logprobs}
        for n in nodes
    ]
    wrong = VLLMServer(config(api_key + "-wrong"))
    try:
        await wrong._tokens_and_logprobs_completion_wrapper(model="tiny", prompt=prompt, n=1)
        res["wrong_key"] = "accepted"
    except Exception as e:  # noqa: BLE001 - aiohttp's ClientResponseError names the status
        res["wrong_key"] = f"{type(e).__name__}: {getattr(e, 'status', '')}"
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))

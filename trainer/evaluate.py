"""Greedy generations with transformers on validation prompts: format-valid rate and reward.

This is the trainer's quick self-check after SFT (no vLLM needed); the full evaluation
(exact match, type accuracy, macro-F1 over a split) lives in ``env_server.evaluate``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads where it runs: ``python -m trainer.evaluate --help`` is quick
    from trainer.model import LoadedModel


def generate_greedy(
    lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 8
) -> list[str]:
    """Greedy completions (left-padded batches), decoded without special tokens."""
    import torch

    from trainer.batch import pad_rows
    from trainer.model import autocast
    from trainer.sft_data import end_of_turn_id

    tok, model = lm.tokenizer, lm.model
    stop = end_of_turn_id(tok)
    pad = tok.pad_token_id
    outputs: list[str] = []
    model.eval()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = pad_rows(chunk, width, pad, torch.long, lm.device, left=True)
        ones = [[1] * len(p) for p in chunk]
        attn = pad_rows(ones, width, 0, torch.long, lm.device, left=True)
        with torch.no_grad(), autocast(lm.device, lm.compute_dtype):
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=pad,
            )
        for row in out[:, width:]:
            outputs.append(tok.decode(row.tolist(), skip_special_tokens=True))
    model.train()
    return outputs


def format_valid_rate(
    lm: LoadedModel,
    rows: list[dict[str, Any]],
    max_seq_len: int,
    max_new_tokens: int,
    latest_only: bool = False,
) -> dict[str, float]:
    """Share of greedy outputs that parse (Shop-R1 format), exact action match, mean reward."""
    from env_server.actions import actions_equal
    from env_server.reward import parse_output, score
    from trainer.sft_data import prompt_ids

    budget = max_seq_len - max_new_tokens
    prompts = [prompt_ids(r, lm.tokenizer, budget, latest_only) for r in rows]
    texts = generate_greedy(lm, prompts, max_new_tokens)
    valid = exact = reward = 0.0
    for text, row in zip(texts, rows, strict=True):
        gold = json.loads(row["action"])
        parsed = parse_output(text)
        if getattr(parsed, "action", None) is not None:
            valid += 1
            exact += float(actions_equal(parsed.action, gold))
        reward += float(score(text, gold).total)
    n = max(len(rows), 1)
    return {"format_valid": valid / n, "exact_match": exact / n, "reward_mean": reward / n}


def main(argv: list[str] | None = None) -> None:
    """``python -m trainer.evaluate --model DIR``: format-valid rate of a saved model."""
    import argparse

    from trainer.config import SftConfig

    p = argparse.ArgumentParser("python -m trainer.evaluate", description=main.__doc__)
    p.add_argument("--model", required=True, help="Model directory (e.g. a checkpoint's model/).")
    p.add_argument("--data-dir", default=SftConfig().data_dir, help="Shop-R1 dataset directory.")
    p.add_argument("--split", default="validation", help="Dataset split to prompt from.")
    p.add_argument("--n", type=int, default=32, help="Number of prompts.")
    p.add_argument("--max-seq-len", type=int, default=1024, help="Prompt + generation budget.")
    p.add_argument("--max-new-tokens", type=int, default=160, help="Generation budget.")
    p.add_argument("--latest-only", action="store_true", help="Latest page only in the prompt.")
    a = p.parse_args(argv)
    from trainer.model import load_model  # torch: after --help
    from trainer.sft_data import load_or_build_dataset

    lm = load_model(SftConfig(model_name=a.model, save_path=""))
    rows = list(load_or_build_dataset(a.data_dir, SftConfig().num_sessions)[a.split])[: a.n]
    result = format_valid_rate(lm, rows, a.max_seq_len, a.max_new_tokens, a.latest_only)
    print(json.dumps({"model": a.model, "n": len(rows), **result}))


if __name__ == "__main__":
    main()

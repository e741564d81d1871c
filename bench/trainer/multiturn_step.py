"""A multi-turn GRPO step against a single-turn step of the same tokens (issue 45 point 5).

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.multiturn_step [--model smol]
        [--turns 6] [--sampled 8] [--reply 16] [--prompt 72] [--batch 16] [--group 8]

The same sequences, two masks: *multi-turn* interleaves ``--turns`` model turns of
``--sampled`` tokens (mask 1) with the environment's ``--reply`` tokens (mask 0) after a
``--prompt``-token prompt, as a guess-the-number episode is laid out
(docs/results/multiturn_guess.md); *single-turn* trains the same number of tokens as one
completion at the end (every reply moved into the prompt's side of the mask). The members of a
group share the prompt and diverge at the first turn. Runs the real GRPO step
(``trainer.grpo_step.grpo_step``, packed prefix tree, the preset's ``--precision auto``, no
KL reference as the guess recipe) interleaved, round by round, on one model instance; round 0
is the warm-up, medians of the rest. Writes ``docs/results/multiturn_step.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine, model_dir


def episodes(args: argparse.Namespace, vocab: int, seed: int, layout: str) -> list[Any]:
    """``--batch / --group`` groups; ``layout`` ``multi`` or ``single`` (module docstring)."""
    from api.protocol import ScoredGroup

    rng = random.Random(seed)
    groups = []
    for g in range(args.batch // args.group):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt)]
        seqs = []
        for i in range(args.group):
            tokens, multi = list(prompt), [0] * args.prompt
            for _ in range(args.turns):
                tokens += [rng.randrange(10, vocab) for _ in range(args.sampled)]
                multi += [1] * args.sampled
                tokens += [rng.randrange(10, vocab) for _ in range(args.reply)]
                multi += [0] * args.reply
            n = sum(multi)
            mask = multi if layout == "multi" else [0] * (len(tokens) - n) + [1] * n
            logprobs = [-rng.uniform(0.1, 4) if m else 0.0 for m in mask]
            seqs.append({"tokens": tokens, "mask": mask, "logprobs": logprobs, "score": i % 3})
        group = {"group_id": f"{layout}{g}", "env": "bench", "policy_version": 0}
        groups.append(ScoredGroup.model_validate({**group, "sequences": seqs}))
    return groups


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.multiturn_step",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default="smol", help="a bench model name (bench/common.py)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--sampled", type=int, default=8, help="tokens per model turn")
    ap.add_argument("--reply", type=int, default=16, help="tokens per environment reply")
    ap.add_argument("--prompt", type=int, default=72)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4, help="the first is a warm-up")
    ap.add_argument("--out", type=Path, default=RESULTS / "multiturn_step.json")
    args = ap.parse_args(argv)

    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.run import start_run

    times: dict[str, list[float]] = {"multi": [], "single": []}
    stats: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GrpoConfig(
            model_name=str(model_dir(args.model)),
            save_path=tmp,
            device="cpu",
            lr=1e-5,
            kl_beta=0.0,
            batch_size=args.batch,
            tensorboard=False,
            overwrite=True,
            training_steps=2 * args.rounds,
            precision="auto",
        )
        run = start_run(cfg)
        ctx = StepContext(run.loaded, None, run.optimizer, run.scheduler, cfg)
        vocab = run.loaded.model.config.vocab_size
        for rnd in range(args.rounds):
            for layout in ("multi", "single") if rnd % 2 == 0 else ("single", "multi"):
                items, _ = flatten_groups(episodes(args, vocab, rnd, layout), cfg.max_seq_len)
                t0 = time.perf_counter()
                out = grpo_step(ctx, items)
                times[layout].append(time.perf_counter() - t0)
                stats[layout] = {
                    k: out[k] for k in ("tokens", "forward_tokens", "sequence_tokens", "turns_mean")
                }
                print(
                    f"round {rnd} {layout}: {times[layout][-1]:.2f} s {stats[layout]}", flush=True
                )
        run.metrics.close()
    med = {k: statistics.median(v[1:] or v) for k, v in times.items()}
    result = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "precision": str(run.loaded.compute_dtype),
        "step_s": times,
        "median_s": med,
        "multi_over_single": med["multi"] / med["single"],
        "stats": stats,
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"median_s": med, "ratio": result["multi_over_single"]}))
    return result


if __name__ == "__main__":
    main()

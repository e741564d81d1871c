"""Shop-R1 sessions as episodes against steps as prompts: tokens computed and time per trained
step (issue 46 point 1).

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.session_episodes [--model smol]
        [--rounds 3] [--no-time]

Tokens (the validation split, the model's tokenizer, no model): for SFT, the tokens of every
sequence that trains the split's steps and the target tokens they train; for GRPO, the tokens
the prefix tree computes for a step of ``--groups`` groups of ``--group`` completions (each
completion the gold turn of another step: real lengths, distinct tokens), the steps drawn as
the env draws them (the step form: rows in a random order; the session form: sessions whole,
steps in order), and the prompt tokens vLLM must prefill when it keeps the previous prompt
cached. Each form at the cpu-smol preset's budgets and at a budget that holds whole sessions.

Time (``--model``, the trainer's ``--precision auto``): one SFT step of ``--sft-batch``
sequences and one GRPO step of the token layout above in each form, interleaved round by
round on one model instance; round 0 is the warm-up, medians of the rest, and per target
token. Writes ``docs/results/session_episodes.json``.
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

FORMS = {  # name: (episode, SFT max_seq_len, rollout prompt budget)
    "step@1024": ("step", 1024, 896),
    "session@1024": ("session", 1024, 896),
    "step@4096": ("step", 4096, 3968),
    "session@4096": ("session", 4096, 3968),
}


def _split(n_sessions: int) -> list[dict[str, Any]]:
    from env_server.data.dataset import build_dataset

    return build_dataset(num_sessions=n_sessions, seed=0)["validation"].to_list()


def sft_tokens(rows: list[dict[str, Any]], tok: Any, episode: str, max_seq_len: int) -> dict:
    """Sequences, tokens and target tokens that train every step of ``rows`` once."""
    from trainer.sft_data import LazySplit

    lazy = LazySplit(rows, tok, max_seq_len, latest_only=False, episode=episode)
    examples = lazy.take(list(range(len(lazy))))
    tokens = sum(len(e.tokens) for e in examples)
    targets = sum(sum(e.loss_mask) for e in examples)
    return {
        "sequences": len(examples),
        "tokens": tokens,
        "target_tokens": targets,
        "tokens_per_target_token": tokens / targets,
        "longest": max(len(e.tokens) for e in examples),
        "skipped": len(lazy.skipped),
        "examples": examples,
    }


def rollout_steps(
    rows: list[dict[str, Any]], tok: Any, episode: str, budget: int, groups: int, group: int
) -> dict:
    """GRPO steps of ``groups`` groups drawn as the env draws them, with their token counts."""
    from env_server.rollout import prompt_ids
    from env_server.service import cycle_rows
    from env_server.sessions import as_episodes, gold_turn
    from trainer.prefix_tree.build import lcp, pack

    if episode == "session":
        rows = as_episodes(rows)
    draw = cycle_rows(rows, 0, episode == "session")
    drawn = [next(draw) for _ in rows]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok(gold_turn(r), add_special_tokens=False)["input_ids"] + [eot] for r in rows]
    rng = random.Random(0)
    steps, prefill, prev = [], 0, []
    for s in range(0, len(drawn) - groups + 1, groups):
        batch = []
        for r in drawn[s : s + groups]:
            p = prompt_ids(r, tok, budget, latest_only=False)
            common = lcp([p, prev]) if prev else 0
            prefill += len(p) - common
            prev = p
            batch += [p + turns[rng.randrange(len(turns))] for _ in range(group)]
        steps.append(batch)
    computed = [pack(b).packed_tokens for b in steps]
    return {
        "steps": len(steps),
        "tokens_per_step": statistics.mean(sum(len(x) for x in b) for b in steps),
        "computed_per_step": statistics.mean(computed),
        "vllm_prefill_tokens_per_prompt": prefill / (len(steps) * groups),
        "batches": steps,
    }


def _groups(batch: list[list[int]], group: int) -> list[Any]:
    from api.protocol import ScoredGroup

    out = []
    for g in range(0, len(batch), group):
        seqs = []
        for i, tokens in enumerate(batch[g : g + group]):
            n = min(80, len(tokens) // 4)  # the completion: the tail (its exact split is moot)
            mask = [0] * (len(tokens) - n) + [1] * n
            logprobs = [-1.0 if m else 0.0 for m in mask]
            seqs.append({"tokens": tokens, "mask": mask, "logprobs": logprobs, "score": i % 3})
        out.append(
            ScoredGroup.model_validate(
                {"group_id": f"g{g}", "env": "bench", "policy_version": 0, "sequences": seqs}
            )
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.session_episodes",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default="smol", help="a bench model name (bench/common.py)")
    ap.add_argument("--sessions", type=int, default=300, help="simulated; 10%% validation")
    ap.add_argument("--groups", type=int, default=4, help="groups per GRPO step")
    ap.add_argument("--group", type=int, default=8, help="completions per group")
    ap.add_argument("--sft-batch", type=int, default=8, help="sequences per SFT step")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds; the first is a warm-up")
    ap.add_argument("--no-time", action="store_true", help="token counts only (no model)")
    ap.add_argument("--out", type=Path, default=RESULTS / "session_episodes.json")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    path = model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    rows = _split(args.sessions)
    sft = {name: sft_tokens(rows, tok, ep, L) for name, (ep, L, _) in FORMS.items()}
    grpo = {
        name: rollout_steps(rows, tok, ep, budget, args.groups, args.group)
        for name, (ep, _, budget) in FORMS.items()
    }
    for name in FORMS:
        s, g = sft[name], grpo[name]
        print(
            f"{name}: SFT {s['tokens']} tokens for {s['target_tokens']} target tokens "
            f"({s['tokens_per_target_token']:.1f} a target token, {s['sequences']} sequences); "
            f"GRPO step {g['computed_per_step']:.0f} tokens computed of {g['tokens_per_step']:.0f}; "
            f"vLLM prefill {g['vllm_prefill_tokens_per_prompt']:.0f} a prompt",
            flush=True,
        )
    timing: dict[str, Any] = {}
    if not args.no_time:
        timing = _time(args, path, sft, grpo)
    result = {
        "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "rows": len(rows),
        "forms": {
            n: {"episode": e, "sft_max_seq_len": L, "prompt_budget": b}
            for n, (e, L, b) in FORMS.items()
        },
        "sft": {n: {k: v for k, v in s.items() if k != "examples"} for n, s in sft.items()},
        "grpo": {n: {k: v for k, v in g.items() if k != "batches"} for n, g in grpo.items()},
        "time": timing,
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(timing.get("median", {}), indent=1))
    return result


def _time(args: argparse.Namespace, path: Path, sft: dict, grpo: dict) -> dict[str, Any]:
    """Median seconds of an SFT step and a GRPO step per form (module docstring)."""
    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig, SftConfig
    from trainer.distributed import Work
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.run import start_run
    from trainer.sft import _step

    times: dict[str, list[float]] = {}
    target_tokens: dict[str, list[int]] = {}
    cpu: dict[str, list[float]] = {}  # CPU seconds of the process (all threads): on a busy
    # box they move less than the wall time
    timed = ("step@1024", "session@4096")  # the preset's form and sessions whole
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(model_name=str(path), device="cpu", tensorboard=False, overwrite=True)
        scfg = SftConfig(
            save_path=f"{tmp}/sft",
            max_seq_len=4096,
            micro_batch_size=4,
            batch_size=args.sft_batch,
            training_steps=10 * args.rounds,
            **common,
        )
        srun = start_run(scfg)
        gcfg = GrpoConfig(
            save_path=f"{tmp}/grpo",
            lr=1e-6,
            kl_beta=0.0,
            batch_size=args.groups * args.group,
            micro_batch_tokens=8192,
            max_seq_len=4096,
            training_steps=10 * args.rounds,
            **common,
        )
        for rnd in range(args.rounds):
            for name in timed if rnd % 2 == 0 else timed[::-1]:
                batch = sft[name]["examples"][rnd * args.sft_batch : (rnd + 1) * args.sft_batch]
                t0, c0 = time.perf_counter(), time.process_time()
                _step(srun, batch, Work())
                dt = time.perf_counter() - t0
                cpu.setdefault(f"sft {name}", []).append(time.process_time() - c0)
                n = sum(sum(e.loss_mask) for e in batch)
                times.setdefault(f"sft {name}", []).append(dt)
                target_tokens.setdefault(f"sft {name}", []).append(n)
                print(f"round {rnd} SFT {name}: {dt:.1f} s, {n} target tokens", flush=True)
        srun.metrics.close()
        del srun
        grun = start_run(gcfg)
        ctx = StepContext(grun.loaded, None, grun.optimizer, grun.scheduler, gcfg)
        for rnd in range(args.rounds):
            for name in timed if rnd % 2 == 0 else timed[::-1]:
                items, _ = flatten_groups(_groups(grpo[name]["batches"][rnd], args.group), 4096)
                t0, c0 = time.perf_counter(), time.process_time()
                out = grpo_step(ctx, items)
                dt = time.perf_counter() - t0
                cpu.setdefault(f"grpo {name}", []).append(time.process_time() - c0)
                times.setdefault(f"grpo {name}", []).append(dt)
                print(
                    f"round {rnd} GRPO {name}: {dt:.1f} s, forward tokens {out['forward_tokens']}",
                    flush=True,
                )
        grun.metrics.close()
    median = {k: statistics.median(v[1:] or v) for k, v in times.items()}
    median_cpu = {k: statistics.median(v[1:] or v) for k, v in cpu.items()}
    ms_per_target = {}
    for k, counts in target_tokens.items():
        pairs = list(zip(times[k], counts, strict=True))
        ms_per_target[k] = 1000 * statistics.median(t / n for t, n in pairs[1:] or pairs)
        pairs = list(zip(cpu[k], counts, strict=True))
        ms_per_target[f"{k} cpu"] = 1000 * statistics.median(t / n for t, n in pairs[1:] or pairs)
    return {
        "step_s": times,
        "step_cpu_s": cpu,
        "median": median,
        "median_cpu": median_cpu,
        "sft_target_tokens": target_tokens,
        "sft_ms_per_target_token": ms_per_target,
        "precision": "auto (trainer/precision.py)",
    }


if __name__ == "__main__":
    main()

"""Trainer step time vs model size, batch size and group size (no servers).

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.step [--models tiny,small,base]
        [--batch-sizes 8] [--group-sizes 4] [--seq-len 512] [--steps 3] [--lora-r 0]

Runs the real GRPO optimizer step (``trainer.grpo_step.grpo_step``: scoring pass with
self-certainty and the KL reference, loss + backward over micro-batches, clip, AdamW) and the
real checkpoint (``Run.checkpoint``: model, optimizer, scheduler, RNG, atomically) on
synthetic scored groups: ``batch size / group size`` groups of ``--seq-len`` tokens (3/4
prompt, 1/4 completion, random ids, random scores), fp32 on CPU, the trainer's defaults
otherwise (micro-batches of 8192 padded tokens, kl_beta 0.001); ``--lora-r R`` trains a LoRA
adapter on every linear layer instead of the full weights (key suffix ``/lora<R>``). The points of one model run
interleaved (round r = one step of each point in turn) on one model instance; round 0 is the
warm-up, the median of the other rounds is reported. Results are merged into docs/results/trainer_step.json
under ``<model>/b<B>/gs<G>/L<len>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import (
    MODEL_SIZES,
    REAL_MODELS,
    RESULTS,
    count_params,
    machine,
    model_dir,
    parse_list,
    write_result,
)

if TYPE_CHECKING:
    from api.protocol import ScoredGroup


def synthetic_groups(
    n_groups: int, gs: int, seq_len: int, vocab: int, seed: int
) -> list[ScoredGroup]:
    """Scored groups in the data contract with random content (scores differ within a group)."""
    from api.protocol import ScoredGroup

    rng = random.Random(seed)
    prompt = seq_len * 3 // 4
    groups = []
    for g in range(n_groups):
        ids = [rng.randrange(10, vocab) for _ in range(prompt)]
        seqs = []
        for _ in range(gs):
            comp = [rng.randrange(10, vocab) for _ in range(seq_len - prompt)]
            seqs.append(
                {
                    "tokens": ids + comp,
                    "mask": [0] * prompt + [1] * len(comp),
                    "logprobs": [0.0] * prompt + [-rng.uniform(0.5, 8) for _ in comp],
                    "score": rng.random(),
                    "spans": {
                        "rationale": [0] * prompt
                        + [1] * (len(comp) // 2)
                        + [0] * (len(comp) - len(comp) // 2)
                    },
                }
            )
        group = {"group_id": f"g{g}", "env": "bench", "policy_version": 0, "sequences": seqs}
        groups.append(ScoredGroup.model_validate(group))
    return groups


def measure(model: str, points: list[tuple[int, int]], args: argparse.Namespace) -> list[dict]:
    """Every (batch, group size) point on one model, interleaved: round r runs one step of
    each point in turn, so a load change on the shared box hits every point alike."""
    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.model import Reference
    from trainer.run import start_run

    for batch, gs in points:
        if batch % gs:
            raise ValueError(f"batch size {batch} is not a multiple of group size {gs}")
    mdir = model_dir(model)
    steps: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    ckpts: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    # CPU seconds of this process (all its threads) per step: on a shared box the wall time
    # also counts the time other processes held the cores, CPU time much less so
    cpus: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GrpoConfig(
            model_name=str(mdir),
            save_path=tmp,
            device="cpu",
            lr=5e-5,
            batch_size=max(b for b, _ in points),
            tensorboard=False,
            overwrite=True,
            training_steps=args.steps * len(points),
            lora_r=args.lora_r,
            precision=args.precision,
            micro_batch_tokens=args.micro_batch_tokens,
        )
        ref: list[Reference] = []
        run = start_run(cfg, before_resume=lambda lm, _d: ref.append(Reference(lm)))
        ctx = StepContext(run.loaded, ref[0], run.optimizer, run.scheduler, cfg)
        vocab = run.loaded.model.config.vocab_size
        for rnd in range(args.steps):
            for batch, gs in points:
                groups = synthetic_groups(batch // gs, gs, args.seq_len, vocab, seed=rnd)
                items, _ = flatten_groups(groups, cfg.max_seq_len)
                c0, t0 = time.process_time(), time.perf_counter()
                stats = grpo_step(ctx, items)
                t1, c1 = time.perf_counter(), time.process_time()
                cpus[(batch, gs)].append(c1 - c0)
                run.state.step += 1
                run.checkpoint()
                t2 = time.perf_counter()
                steps[(batch, gs)].append(t1 - t0)
                ckpts[(batch, gs)].append(t2 - t1)
                print(
                    f"  {model} b={batch} gs={gs} L={args.seq_len} round {rnd}: compute "
                    f"{t1 - t0:.2f}s (cpu {c1 - c0:.1f}s) checkpoint {t2 - t1:.2f}s "
                    f"({stats['micro_batches']} micro-batches)",
                    flush=True,
                )
        run.metrics.close()
    out = []
    for batch, gs in points:
        s, c, cpu = steps[(batch, gs)], ckpts[(batch, gs)], cpus[(batch, gs)]
        steady_s, steady_c = s[1:] or s, c[1:] or c
        out.append(
            {
                "model": model,
                "params": count_params(mdir),
                "batch_sequences": batch,
                "group_size": gs,
                "seq_len": args.seq_len,
                "tokens": batch * args.seq_len,
                "compute_s": s,
                "checkpoint_s": c,
                "compute_median_s": statistics.median(steady_s),
                "cpu_s": cpu,
                "cpu_median_s": statistics.median(cpu[1:] or cpu),
                "checkpoint_median_s": statistics.median(steady_c),
                "tokens_per_s": batch * args.seq_len / statistics.median(steady_s),
                "lora_r": args.lora_r,
                "precision": args.precision,
                "micro_batch_tokens": args.micro_batch_tokens,
                "interleaved_with": [list(p) for p in points],
                "machine": machine(),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.step",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "--models",
        default="tiny",
        help=f"comma list of {sorted(MODEL_SIZES)} or {list(REAL_MODELS)}",
    )
    ap.add_argument("--batch-sizes", default="8", help="sequences per step, comma list")
    ap.add_argument(
        "--group-sizes",
        default="4",
        help="comma list; pairs where it does not divide the batch are skipped",
    )
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    ap.add_argument(
        "--steps", type=int, default=3, help="rounds (steps per point; the first is a warm-up)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="trainer compute precision (bf16: autocast, fp32 master weights)",
    )
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=8192,
        help="padded tokens per forward/backward (the trainer's default: 8192)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "trainer_step.json")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # Every (batch, group size) pair where the group size divides the batch.
    pairs = [(b, g) for b in parse_list(args.batch_sizes) for g in parse_list(args.group_sizes)]
    points = [(b, g) for b, g in pairs if g <= b and b % g == 0]
    if not points:
        raise SystemExit("error: no group size divides a batch size")
    for model in parse_list(args.models, str):
        for r in measure(model, points, args):
            key = f"{model}/b{r['batch_sequences']}/gs{r['group_size']}/L{args.seq_len}"
            key += f"/lora{args.lora_r}" if args.lora_r else ""
            key += "/bf16" if args.precision == "bf16" else ""
            write_result(args.out, key, r)
            print(
                f"{model} ({r['params'] / 1e6:.1f}M) b={r['batch_sequences']} "
                f"gs={r['group_size']} L={args.seq_len}: compute {r['compute_median_s']:.2f}s "
                f"({r['tokens_per_s']:.0f} tok/s), checkpoint {r['checkpoint_median_s']:.2f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()

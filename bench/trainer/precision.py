"""GRPO step time per trainer ``--precision`` (fp32 / auto / bf16) on the CPU (no servers).

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.precision [--model tiny]
        [--batch-size 8] [--group-size 4] [--seq-len 512] [--steps 3] [--precisions fp32,auto,bf16]

The real GRPO step (``trainer.grpo_step.grpo_step``) on bench/trainer/step.py's synthetic
scored groups, once per precision: one model instance per precision, loaded through the
trainer (so ``auto`` is resolved exactly as a run resolves it, trainer/precision.py), and the
precisions interleaved round by round (round r = one step of each in turn) so that a load
change on the shared box hits them alike; round 0 is the warm-up, medians of the rest. Each
step records wall seconds and the CPU seconds of this process (``time.process_time``: on a
busy box the wall time also counts the time other processes held the cores).

Run it with ``ONEDNN_MAX_CPU_ISA=AVX2`` to see a CPU without native bf16: oneDNN then
emulates bf16 matmuls as on an AVX2-only CPU (``ATEN_CPU_CAPABILITY=avx2`` does not: matmuls
go through oneDNN, which picks its own ISA). Results are merged into
docs/results/trainer_precision.json under ``<model>/b<B>/gs<G>/L<len>/<isa>/<precision>``
(``isa`` = ``native`` or the ``ONEDNN_MAX_CPU_ISA`` value) and tabled by bench/report/build.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import (
    RESULTS,
    count_params,
    machine,
    model_dir,
    parse_list,
    write_result,
)
from bench.trainer.step import synthetic_groups


def matmul_gflops(size: int = 512, reps: int = 20) -> dict[str, float]:
    """GFLOP/s of one ``size`` x ``size`` matmul per dtype, one thread (mean of ``reps``, after
    a warm-up): the number issue 21 quoted (AVX2-only EPYC: bf16 1.2, fp32 65.6)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            a @ b
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            out[name] = round(2 * size**3 * reps / (time.perf_counter() - t0) / 1e9, 1)
        return out
    finally:
        torch.set_num_threads(threads)


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.model import Reference
    from trainer.run import start_run

    if args.batch_size % args.group_size:
        raise SystemExit(f"error: group size {args.group_size} does not divide {args.batch_size}")
    mdir = model_dir(args.model)
    precisions = parse_list(args.precisions, str)
    wall: dict[str, list[float]] = {p: [] for p in precisions}
    cpu: dict[str, list[float]] = {p: [] for p in precisions}
    with contextlib.ExitStack() as stack:
        ctxs = {}
        for prec in precisions:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            cfg = GrpoConfig(
                model_name=str(mdir),
                save_path=tmp,
                device="cpu",
                lr=5e-5,
                precision=prec,
                batch_size=args.batch_size,
                tensorboard=False,
                overwrite=True,
                training_steps=args.steps,
            )
            ref: list[Reference] = []
            run = start_run(cfg, before_resume=lambda lm, _d, r=ref: r.append(Reference(lm)))
            stack.callback(run.metrics.close)
            ctxs[prec] = StepContext(run.loaded, ref[0], run.optimizer, run.scheduler, cfg)
        vocab = ctxs[precisions[0]].loaded.model.config.vocab_size
        n_groups = args.batch_size // args.group_size
        for rnd in range(args.steps):
            groups = synthetic_groups(n_groups, args.group_size, args.seq_len, vocab, seed=rnd)
            for prec in precisions:
                ctx = ctxs[prec]
                items, _ = flatten_groups(groups, ctx.cfg.max_seq_len)
                c0, t0 = time.process_time(), time.perf_counter()
                grpo_step(ctx, items)
                t1, c1 = time.perf_counter(), time.process_time()
                wall[prec].append(t1 - t0)
                cpu[prec].append(c1 - c0)
                print(
                    f"  {prec} ({ctx.loaded.compute_dtype}) round {rnd}: {t1 - t0:.2f}s wall, "
                    f"{c1 - c0:.2f}s cpu",
                    flush=True,
                )
        dtypes = {p: str(ctxs[p].loaded.compute_dtype).removeprefix("torch.") for p in precisions}
    gflops = matmul_gflops()
    out = []
    for prec in precisions:
        w, c = wall[prec][1:] or wall[prec], cpu[prec][1:] or cpu[prec]
        out.append(
            {
                "model": args.model,
                "params": count_params(mdir),
                "batch_sequences": args.batch_size,
                "group_size": args.group_size,
                "seq_len": args.seq_len,
                "precision": prec,
                "compute_dtype": dtypes[prec],
                "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                "threads": torch.get_num_threads(),
                "wall_s": wall[prec],
                "cpu_s": cpu[prec],
                "wall_median_s": statistics.median(w),
                "cpu_median_s": statistics.median(c),
                "interleaved_with": precisions,
                "matmul_512_gflops_1_thread": gflops,
                "machine": machine(),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.precision",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default="tiny", help="a bench/common.py MODEL_SIZES name")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=3, help="rounds (the first is a warm-up)")
    ap.add_argument("--precisions", default="fp32,auto,bf16", help="comma list")
    ap.add_argument("--out", type=Path, default=RESULTS / "trainer_precision.json")
    args = ap.parse_args()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "native")
    for r in measure(args):
        key = (
            f"{args.model}/b{args.batch_size}/gs{args.group_size}/L{args.seq_len}/"
            f"{isa.lower()}/{r['precision']}"
        )
        write_result(args.out, key, r)
        print(
            f"{key}: {r['compute_dtype']} {r['wall_median_s']:.2f}s wall, "
            f"{r['cpu_median_s']:.2f}s cpu",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""The cost probe's measurement (launch/cost_probe.py), in a process of its own so that the
launcher never imports torch nor keeps the model it timed:

    python -m launch.cost_measure REQUEST.json RESULT.json

REQUEST holds the phase (``sft`` or ``grpo``), its trainer config, the model folder, the
step's shape (``cost_probe.PhaseShape``) and the thread count; RESULT gets the
``cost_probe.Estimate`` (the shape as probed: an SFT runs on its first training examples when
the dataset is there, else random tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from launch.cost_estimate import Estimate, PhaseShape

Rows = list[tuple[list[int], list[int]]]
"""Sequences of one pass with their loss masks (1 = a target token)."""
LENGTH_SAMPLE = 256
"""Examples (the first the SFT draws) whose mean length scales the probed SFT rows to a
micro-batch: the first few alone are not typical (cpu-smol's first two: 914 tokens on average,
the first 256: 793, so rows alone scaled the step ~15% high)."""


def measure_step(
    cfg: Any,
    model_dir: str | Path,
    shape: PhaseShape,
    threads: int | None,
    examples: Rows | None = None,
    timed: int = 1,
) -> Estimate:
    """Seconds of one optimizer step of ``shape`` on this machine: the model loaded with the
    trainer's loader from the phase's config ``cfg`` (``SftConfig``/``GrpoConfig``) on the CPU,
    ``threads`` torch threads, a small warm-up step, then ``timed`` steps (the best is kept),
    each pass on ``examples`` (else random rows of ``shape``)."""
    import torch

    from trainer.forward import target_nll
    from trainer.model import autocast, load_model
    from trainer.optim import build_optimizer, build_scheduler, clip_and_step

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        lm = load_model(cfg.model_copy(update={"model_name": str(model_dir), "device": "cpu"}))
        lm.model.train()
        optimizer = build_optimizer(lm.model, cfg)
        scheduler = build_scheduler(optimizer, cfg)
        vocab = int(lm.model.get_input_embeddings().weight.shape[0])
        gen = torch.Generator().manual_seed(0)

        def rows(n: int, prompt: int, completion: int) -> Rows:
            shared = torch.randint(3, vocab, (prompt,), generator=gen).tolist()
            tail = torch.randint(3, vocab, (n, completion), generator=gen).tolist()
            return [(shared + t, [0] * prompt + [1] * completion) for t in tail]

        def nll(batch: Rows) -> torch.Tensor:
            seqs, masks = [s for s, _ in batch], [m for _, m in batch]
            pad = lm.tokenizer.pad_token_id or 0
            with autocast(lm.device, lm.compute_dtype):
                return target_nll(
                    lm.model, seqs, masks, lm.device, lm.tree_attention, cfg.min_shared_prefix, pad
                )

        def step(batch: Rows) -> tuple[float, float, float]:
            t0 = time.perf_counter()
            (nll(batch) / sum(len(s) for s, _ in batch)).backward()
            t1 = time.perf_counter()
            with torch.no_grad():
                for _ in range(min(1, shape.scoring_forwards)):  # one timed, the others alike
                    nll(batch)
            t2 = time.perf_counter()
            clip_and_step(lm.model, optimizer, scheduler, cfg.max_grad_norm)
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        step(rows(1, min(shape.prompt, 64), min(shape.completion, 128)))  # kernels, AdamW
        best, wall0, cpu0 = math.inf, time.perf_counter(), time.process_time()
        for _ in range(max(1, timed)):
            fb, fwd, opt = step(examples or rows(shape.rows, shape.prompt, shape.completion))
            per_pass = (fb + fwd * shape.scoring_forwards) * shape.scale
            best = min(best, per_pass * shape.passes + opt)
        wall = (time.perf_counter() - wall0) * torch.get_num_threads()
        share = min(1.0, (time.process_time() - cpu0) / wall) if wall > 0 else 1.0
        precision = "bf16" if lm.compute_dtype == torch.bfloat16 else "fp32"
        return Estimate(shape, best, precision, max(1, timed), share)
    finally:
        torch.set_num_threads(before)


def sft_examples(sft: Any, model_dir: str | Path, n: int) -> tuple[Rows, float] | None:
    """The first ``n`` examples the SFT will train on (epoch 0's order, as trainer/sft.py
    draws them), tokenized with ``model_dir``'s tokenizer, and the mean length in tokens of
    the first ``LENGTH_SAMPLE`` it draws; None without a dataset."""
    if not (Path(sft.data_dir) / "train.jsonl").exists():
        return None
    from trainer.model import load_tokenizer
    from trainer.sft_data import LazySplit, load_or_build_dataset

    data = load_or_build_dataset(sft.data_dir, sft.num_sessions)
    tok = load_tokenizer(str(model_dir))
    split = LazySplit(
        data["train"], tok, sft.max_seq_len, sft.latest_only, sft.episode, sft.stratify
    )
    order = split.order(sft.seed, 0)
    found = split.take(order[: max(4 * n, LENGTH_SAMPLE)])
    if not found:
        return None
    sample = found[:LENGTH_SAMPLE]
    mean = sum(len(e.tokens) for e in sample) / len(sample)
    return [(e.tokens, e.loss_mask) for e in found[:n]], mean


def measure_phase(
    phase_cfg: Any, model_dir: str | Path, shape: PhaseShape, threads: int | None
) -> Estimate:
    """:func:`measure_step` on the SFT's first training examples where the dataset is there,
    scaled by tokens to a micro-batch of rows of the SFT's mean length (the shape then says
    so), and what bf16 is on this CPU (``trainer.precision.cpu_bf16``)."""
    from trainer.config import SftConfig
    from trainer.precision import cpu_bf16

    examples = None
    sft = isinstance(phase_cfg, SftConfig)
    found = sft_examples(phase_cfg, model_dir, shape.rows) if sft else None
    if found:
        examples, mean = found
        longest = max(len(t) for t, _ in examples)
        source = (
            f"the first training examples, the longest shown; the real rows {mean:.0f} tokens "
            f"on average over the first {LENGTH_SAMPLE}"
        )
        probed = sum(len(t) for t, _ in examples)
        scale = phase_cfg.micro_batch_size * mean / probed
        shape = replace(shape, rows=len(examples), completion=longest, source=source, scale=scale)
    est = measure_step(phase_cfg, model_dir, shape, threads, examples)
    return replace(est, bf16=cpu_bf16()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m launch.cost_measure", description=__doc__)
    ap.add_argument("request", type=Path, help="the JSON request the launcher wrote")
    ap.add_argument("result", type=Path, help="where the Estimate goes (JSON)")
    args = ap.parse_args(argv)

    from trainer.config import GrpoConfig, SftConfig

    request = json.loads(args.request.read_text())
    kind = {"sft": SftConfig, "grpo": GrpoConfig}[request["kind"]]
    cfg = kind.model_validate(request["config"])
    shape = PhaseShape(**request["shape"])
    est = measure_phase(cfg, request["model_dir"], shape, request["threads"])
    args.result.write_text(json.dumps(asdict(est)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The packed trainer's CPU attention, before and after its two changes, measured in one run.

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.tree_kernels --preset cpu-tiny \
        --threads 1,2 --rounds 3

``before``: what the trainer ran before: batched children through one SDPA call (the shared
ancestors' keys and values copied to every child), and transformers' ``[N, N]`` mask of the
packed row built on every forward (the tree's attention never reads it). ``after``: what it
runs now (trainer/tree_attention.py: ``_cascade`` where ``use_cascade`` picks it, ``_IN_TREE``).
Each point is one
real optimizer step of the preset, in a fresh process with ``--threads`` torch threads, after
a warm-up step on the same batch: a GRPO step of ``--groups`` groups (real Shop-R1 prompts,
random completions; the preset's precision and KL reference) and an SFT step of the preset's
batch of real examples. The kernels alternate inside every round, so a load change on a shared
box hits both alike; medians over the rounds. The loss of both kernels is recorded: it must
agree (fp32 summation order apart). Results: docs/results/tree_kernels.json under
``<preset>/<kind>/t<threads>/<kernel>``.
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

from bench.common import RESULTS, machine, parse_list, run_child, write_child_result, write_result
from bench.trainer.packing import _preset, groups_of, real_prompts

KERNELS = ("before", "after")


def _old_kernels() -> None:
    """Put back what ran before: the SDPA call for batched children, and the mask."""
    from trainer.prefix_tree import attention as tree_attention

    tree_attention._cascade = tree_attention._batched
    tree_attention._mask = lambda plain: plain


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["kernel"] == "before":
        _old_kernels()  # before the model loads: enable() registers the mask builder
    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig, SftConfig
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.model import Reference, load_model
    from trainer.optim import build_optimizer, build_scheduler, clip_and_step

    sec, grpo = spec["section"], spec["kind"] == "grpo"
    cls = GrpoConfig if grpo else SftConfig
    with tempfile.TemporaryDirectory() as tmp:
        keep = {k: v for k, v in sec.items() if k in cls.model_fields and k != "training_steps"}
        over = {"model_name": spec["model"], "save_path": tmp, "tensorboard": False}
        cfg = cls(**{**keep, **over, "packing": "prefix_tree", "device": "cpu"})
        lm = load_model(cfg)
        opt = build_optimizer(lm.model, cfg)
        sched = build_scheduler(opt, cfg)
        if grpo:
            vocab = int(lm.model.get_output_embeddings().weight.shape[0])
            ctx = StepContext(lm, Reference(lm) if cfg.kl_beta > 0 else None, opt, sched, cfg)
            prompts = real_prompts(lm.tokenizer, spec["groups"], spec["prompt_tokens"], 0)
            lo, hi = spec["completion"]
            groups = groups_of(prompts, spec["group_size"], lo, hi, vocab, spec["seed"])
            items, _ = flatten_groups(groups, cfg.max_seq_len)

            def step() -> float:
                return float(grpo_step(ctx, items)["loss"])
        else:
            from settings.paths import DATA_DIR
            from trainer.sft import _nll
            from trainer.sft_data import encode_split, load_or_build_dataset

            rows = list(load_or_build_dataset(DATA_DIR, None)["train"])
            batch = encode_split(
                random.Random(spec["seed"]).sample(rows, cfg.batch_size),
                lm.tokenizer,
                cfg.max_seq_len,
                cfg.latest_only,
            )

            def step() -> float:
                n_target = float(sum(sum(e.loss_mask[1:]) for e in batch))
                with torch.autocast(
                    "cpu", dtype=lm.compute_dtype, enabled=lm.compute_dtype != torch.float32
                ):
                    nll = _nll(lm, batch, cfg)
                (nll / n_target).backward()
                clip_and_step(lm.model, opt, sched, cfg.max_grad_norm)
                return float(nll)

        state = {k: v.detach().clone() for k, v in lm.model.state_dict().items()}
        step()  # warm-up on the same batch, then the measured step from the same weights
        lm.model.load_state_dict(state)
        t0 = time.perf_counter()
        loss = step()
        return {"step_s": time.perf_counter() - t0, "loss": loss, "threads": spec["threads"]}


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.tree_kernels",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--preset", default="cpu-tiny")
    ap.add_argument("--threads", default="1,2", help="torch threads per point")
    ap.add_argument("--groups", type=int, default=4, help="GRPO groups per step")
    ap.add_argument("--group-size", type=int, default=None, help="default: the preset env's")
    ap.add_argument("--completion-tokens", default="20-90", help="range of completion lengths")
    ap.add_argument("--kinds", default="grpo,sft")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "tree_kernels.json")
    a = ap.parse_args()
    if a.child:
        write_child_result(a.child_result, child(json.loads(a.child)))
        return
    preset = _preset(a.preset)
    trainer, env = preset.get("trainer") or {}, preset["env"]
    lo, hi = (int(x) for x in a.completion_tokens.split("-"))
    prompt_tokens = int(env["max_prompt_tokens"])
    specs = [
        {
            "kind": kind,
            "kernel": kernel,
            "threads": threads,
            "model": preset["launch"]["base_model"] if kind == "sft" else preset["model"],
            "section": trainer.get(kind) or {},
            "groups": a.groups,
            "group_size": a.group_size or int(env["group_size"]),
            "prompt_tokens": prompt_tokens,
            "completion": [lo, hi],
        }
        for kind in parse_list(a.kinds, str)
        for threads in parse_list(a.threads)
        for kernel in KERNELS
    ]
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(specs))}
    for rnd in range(a.rounds):
        for i, spec in enumerate(specs):
            r = run_child("bench.trainer.tree_kernels", {**spec, "seed": rnd})
            runs[i].append(r)
            print(
                f"round {rnd} {spec['kind']} t{spec['threads']} {spec['kernel']}: "
                f"{r['step_s']:.2f} s (loss {r['loss']:.6f})",
                flush=True,
            )
    for i, spec in enumerate(specs):
        row = {
            "step_s": statistics.median(r["step_s"] for r in runs[i]),
            "step_s_all": [r["step_s"] for r in runs[i]],
            "loss_all": [r["loss"] for r in runs[i]],
            "rounds": a.rounds,
            "machine": machine(),
            **{k: v for k, v in spec.items() if k != "section"},
        }
        key = f"{a.preset}/{spec['kind']}/t{spec['threads']}/{spec['kernel']}"
        write_result(a.out, key, row)
        print(f"{key}: median {row['step_s']:.2f} s", flush=True)


if __name__ == "__main__":
    main()

"""One trainer process of the FSDP2 tests (``test_trainer_fsdp.py``): run as ``torchrun
--nproc-per-node N tests/integration/fsdp_worker.py ...`` or as a plain single process.

It builds the GRPO trainer exactly as ``python -m trainer grpo`` does (``start_run``: the
process group, FSDP2 sharding, resume), then runs GRPO steps on fixed batches instead of
leased ones, and has rank 0 write the whole model and optimizer state (gathered, CPU) to
``--out`` as ``{tag: {"model": ..., "optim": ..., "stats": ...}}`` for the test to compare
(and, ``save`` under torchrun, ``"replica"``: rank 0's weight-sync copy after the gather).

Modes: ``step`` (one step on batch 1), ``save`` (step on batch 1, checkpoint, step on batch 2),
``resume`` (resume the latest checkpoint, then step on batch 2), ``grads`` (batch 1's
gradients, gathered whole on rank 0 as ``{"grads": ..., "stats": ...}``, nothing stepped).

Several jobs run in one process, one after another, given as their arguments separated by
``::``: each job calls ``start_run`` afresh (seeds, model, optimizer, resume), and under
torchrun they share the process group (``init_distributed`` joins the one already set up).
The tests start three processes (11 jobs) instead of thirteen: the start-up (imports, the
group) was most of each run's time.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from api.protocol import ScoredGroup
from trainer.batch import flatten_groups
from trainer.config import GrpoConfig
from trainer.dist_weights import SyncReplica, make_replica
from trainer.distributed import Dist, Work, full_tensor, shutdown
from trainer.grpo_step import StepContext, accumulate, grpo_step
from trainer.model import Reference
from trainer.run import Run, setup_logging, start_run

VOCAB = 2600  # token ids drawn below the tiny model's vocabulary (2646)
JOB_SEP = "::"
"""Separates the jobs of one process on the command line."""


def make_groups(
    seed: int, n_groups: int = 3, size: int = 4, shared: bool = False
) -> list[ScoredGroup]:
    """Groups of different lengths, so micro-batches differ in size and count per rank;
    ``shared``: a group's members continue one 24-token prompt (a prefix tree to pack)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        seqs = []
        prompt = torch.randint(0, VOCAB, (24,), generator=g).tolist() if shared else []
        for si in range(size):
            n_prompt, n_comp = 6 + gi, 5 + 3 * si
            tokens = torch.randint(0, VOCAB, (n_prompt + n_comp,), generator=g).tolist()
            if shared:
                n_prompt, tokens = len(prompt), prompt + tokens[n_prompt:]
            lps = (-torch.rand(n_comp, generator=g) * 6).tolist()
            seqs.append(
                {
                    "tokens": tokens,
                    "mask": [0] * n_prompt + [1] * n_comp,
                    "logprobs": [0.0] * n_prompt + lps,
                    "score": float((si + gi) % 3),
                    "spans": {"rationale": [0] * n_prompt + [1] * (n_comp - 1) + [0]},
                }
            )
        group = {"group_id": f"g{seed}-{gi}", "env": "toy", "policy_version": 0, "sequences": seqs}
        groups.append(ScoredGroup.model_validate(group))
    return groups


def snapshot(run: Run, stats: dict[str, float] | None) -> dict[str, Any] | None:
    """Whole model + optimizer state on rank 0 (a collective under torchrun)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(run.loaded.model, run.optimizer, options=opts)
    if not run.is_main:
        return None
    clone = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    optim = {k: {n: clone(v) for n, v in s.items()} for k, s in optim_sd["state"].items()}
    return {
        "model": {k: clone(v) for k, v in model_sd.items()},
        "optim": optim,
        "stats": stats,
        "step": run.state.step,
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["step", "save", "resume", "grads"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--max-grad-norm", type=float, default=0.1)  # below the steps' norms
    ap.add_argument("--packing", default="prefix_tree", choices=["prefix_tree", "padded"])
    ap.add_argument("--shared-prompts", action="store_true")
    return ap


def run_job(a: argparse.Namespace) -> Dist | None:
    """One job: a fresh ``start_run`` (model, optimizer, resume, seeds), its steps, its
    snapshots; returns the process group, which the next job of the process joins again."""
    cfg = GrpoConfig(
        model_name=a.model,
        save_path=a.save,
        lr=1e-3,
        warmup_steps=0,
        kl_beta=0.1,
        micro_batch_tokens=64,
        tensorboard=False,
        training_steps=4,
        device="cpu",
        precision=a.precision,
        resume=a.mode == "resume",
        lora_r=8 if a.lora else 0,
        lora_alpha=16,
        max_grad_norm=a.max_grad_norm,
        packing=a.packing,
    )
    reference: list[Reference] = []
    replica: list[torch.nn.Module | None] = []  # rank 0's weight-sync copy (as trainer.grpo)

    def prepare(lm: Any, d: Any) -> None:
        reference.append(Reference(lm))
        replica.append(make_replica(lm.model, d))

    run = start_run(cfg, before_resume=prepare)
    if run.dist is not None:
        reference[0].shard(run.dist)
    ctx = StepContext(
        run.loaded, reference[0], run.optimizer, run.scheduler, cfg, Work.of(run.dist)
    )
    out: dict[str, Any] = {}

    def step(seed: int) -> dict[str, float]:
        groups = make_groups(seed, shared=a.shared_prompts)
        stats = grpo_step(ctx, flatten_groups(groups, cfg.max_seq_len)[0])
        run.state.step += 1
        return stats

    if a.mode == "grads":
        stats = accumulate(ctx, flatten_groups(make_groups(1, shared=a.shared_prompts), 4096)[0])
        grads = {
            n: full_tensor(p.grad)
            for n, p in run.loaded.model.named_parameters()
            if p.grad is not None
        }
        out = {"grads": {n: g.detach().cpu().clone() for n, g in grads.items()}, "stats": stats}
    elif a.mode == "resume":
        out["loaded"] = snapshot(run, None)
        out["after2"] = snapshot(run, step(2))
    else:
        out["after1"] = snapshot(run, step(1))
        if run.dist is not None:  # gather into the replica, as after every GRPO step
            SyncReplica(run.loaded.model, replica[0], run.dist, run.loaded.is_lora).gather()
            if run.is_main:
                out["replica"] = {n: p.detach().clone() for n, p in replica[0].named_parameters()}
        if a.mode == "save":
            run.checkpoint()
            out["after2"] = snapshot(run, step(2))
    if run.is_main:
        torch.save(out, a.out)
    run.metrics.close()
    return run.dist


def main(argv: list[str] | None = None) -> None:
    """Run the jobs given on the command line, separated by ``::``, one after another in this
    process (one import of torch and transformers, one process group for all of them)."""
    argv = sys.argv[1:] if argv is None else argv
    jobs: list[list[str]] = [[]]
    for arg in argv:
        if arg == JOB_SEP:
            jobs.append([])
        else:
            jobs[-1].append(arg)
    setup_logging()
    d = None
    for job in jobs:
        d = run_job(parser().parse_args(job))
    shutdown(d)


if __name__ == "__main__":
    main()

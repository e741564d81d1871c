"""The trainer at 1 vs N ranks (torchrun + FSDP2): memory per rank, step time, the gather a
sharded trainer adds to every weight sync, and (``--checkpoint``) a sharded checkpoint.

    python -m bench.trainer.fsdp_scaling [--model tiny|small|base] [--ranks 1,2] [--steps 3]
        [--device cpu|cuda] [--checkpoint] [--results FILE]

On CPU the ranks use gloo and world size 1 is a plain process; with ``--device cuda`` every
world size (1 included) runs under torchrun with NCCL, one GPU per rank, and each rank also
records its CUDA peak memory. ``--checkpoint`` then times, per world size, the trainer's
sharded checkpoint (``Run.checkpoint``: DCP save + the Hugging Face export), the export
alone, and a resume (``load_sharded`` after one more step) that must restore every local
parameter and AdamW shard exactly; rank 0 loads the exported folder with transformers and
compares it with the gathered weights.

Each world size runs the trainer's own ``start_run`` (process group, sharding, KL reference,
rank 0's sync replica, as ``python -m trainer grpo`` builds them) and times GRPO steps on one
fixed batch. Per rank it records the bytes of its parameters and of its AdamW state (local
shards: what FSDP2 divides), its peak RSS (everything: libraries, activations, the frozen
reference, rank 0's replica), the median step time, and (N > 1) the median time of
``SyncReplica.gather`` (every parameter ``full_tensor()``-ed into rank 0's replica, the step
before the unchanged bridge sends it). Results: ``docs/results/fsdp_scaling.json`` (key =
``"<model> threads=<OMP threads per rank>"``, `` cuda`` appended on CUDA), summarised in docs/results/fsdp_scaling.md. The box is shared: read the load average recorded
with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import REPO, RESULTS, machine, model_dir, parse_list, write_result

if TYPE_CHECKING:
    from api.protocol import ScoredGroup


def make_groups(
    vocab: int, n_groups: int, size: int, prompt: int, completion: int
) -> list[ScoredGroup]:
    import torch

    from api.protocol import ScoredGroup

    g = torch.Generator().manual_seed(0)
    groups = []
    for gi in range(n_groups):
        seqs = []
        for si in range(size):
            tokens = torch.randint(0, vocab - 50, (prompt + completion,), generator=g).tolist()
            seqs.append(
                {
                    "tokens": tokens,
                    "mask": [0] * prompt + [1] * completion,
                    "logprobs": [0.0] * prompt + [-2.0] * completion,
                    "score": float(si % 3),
                    "spans": {"rationale": [0] * prompt + [1] * completion},
                }
            )
        group = {"group_id": f"g{gi}", "env": "bench", "policy_version": 0, "sequences": seqs}
        groups.append(ScoredGroup.model_validate(group))
    return groups


def local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(a: argparse.Namespace) -> None:
    import resource

    import torch
    import torch.distributed as dist

    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig
    from trainer.dist_weights import SyncReplica, make_replica
    from trainer.distributed import Work, shutdown
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.model import Reference
    from trainer.run import start_run

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = GrpoConfig(
        model_name=a.model_path,
        save_path=a.save,
        lr=1e-5,
        device=a.device,
        precision=a.precision,
        kl_beta=0.05,
        micro_batch_tokens=a.micro_tokens,
        tensorboard=False,
        training_steps=a.steps + 1,
    )
    ref: list[Reference] = []
    replica: list[Any] = []

    def prepare(lm: Any, d: Any) -> None:
        ref.append(Reference(lm))
        replica.append(make_replica(lm.model, d))

    run = start_run(cfg, before_resume=prepare)
    d = run.dist
    if d is not None:
        ref[0].shard(d)
    ctx = StepContext(run.loaded, ref[0], run.optimizer, run.scheduler, cfg, Work.of(d))
    vocab = int(run.loaded.model.get_output_embeddings().weight.shape[0])
    items = flatten_groups(
        make_groups(vocab, a.groups, a.group_size, a.prompt, a.completion), cfg.max_seq_len
    )[0]
    gathered = SyncReplica(run.loaded.model, replica[0], d, False) if d is not None else None
    cuda = a.device == "cuda"
    grpo_step(ctx, items)  # warm-up; creates the AdamW state
    steps, gathers = [], []
    for _ in range(a.steps):
        if d is not None:
            d.barrier()
        t0 = time.perf_counter()
        grpo_step(ctx, items)
        _sync(cuda)
        steps.append(time.perf_counter() - t0)
        if gathered is not None:
            t0 = time.perf_counter()
            gathered.gather()
            _sync(cuda)
            gathers.append(time.perf_counter() - t0)
    state = [t for s in run.optimizer.state.values() for t in s.values() if t.dim() > 0]
    row = {
        "params_bytes": local_bytes(run.loaded.model.parameters()),
        "optim_bytes": local_bytes(state),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": steps,
        "gather_s": gathers,
    }
    if cuda:
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        row["cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
        row["gpu"] = torch.cuda.get_device_name()
    if a.checkpoint and d is not None:
        row.update(checkpoint_round(run, ctx, items, Path(a.save), cuda))
    rows = [row]
    if d is not None:
        rows = [None] * d.world_size
        dist.all_gather_object(rows, row, group=d.control)
    if run.is_main:
        Path(a.out).write_text(json.dumps(rows))
    run.metrics.close()
    shutdown(d)


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def _local_copy(run: Any) -> dict[str, Any]:
    """This rank's shards of every parameter and AdamW state tensor (clones)."""
    out = {}
    for name, p in run.loaded.model.named_parameters():
        p = p.detach()
        out[name] = (p.to_local() if hasattr(p, "to_local") else p).clone()
        for k, v in run.optimizer.state.get(run.loaded.model.get_parameter(name), {}).items():
            v = v.to_local() if hasattr(v, "to_local") else v
            out[f"{name}/{k}"] = v.clone()
    return out


def checkpoint_round(run: Any, ctx: Any, items: list, save: Path, cuda: bool) -> dict:
    """Time the sharded checkpoint, the HF export alone and an exact resume (all ranks)."""
    import torch

    from trainer.dist_checkpoint import export_hf, full_model_state, load_sharded
    from trainer.grpo_step import grpo_step

    d = run.dist
    run.state.step = 1
    d.barrier()
    t0 = time.perf_counter()
    path = run.checkpoint()
    ckpt_s = time.perf_counter() - t0
    saved = _local_copy(run)
    d.barrier()
    t0 = time.perf_counter()
    export_hf(run.loaded.model, run.loaded.tokenizer, save / "export-probe", d)
    export_s = time.perf_counter() - t0
    grpo_step(ctx, items)  # move away from the checkpoint, then come back
    moved = _local_copy(run)
    moved_any = any(not torch.equal(saved[k], moved[k]) for k in saved)
    d.barrier()
    t0 = time.perf_counter()
    load_sharded(path, run.loaded.model, run.optimizer, run.scheduler, d.rank)
    _sync(cuda)
    resume_s = time.perf_counter() - t0
    now = _local_copy(run)
    exact = saved.keys() == now.keys() and all(torch.equal(saved[k], now[k]) for k in saved)
    full = full_model_state(run.loaded.model)  # a collective; rank 0 holds the weights
    hf_diff = None
    if d.is_main:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)
        own = hf.state_dict()
        hf_diff = max(
            (own[k].float() - v.float()).abs().max().item() for k, v in full.items() if k in own
        )
    bytes_on_disk = sum(f.stat().st_size for f in (path / "dcp").rglob("*") if f.is_file())
    return {
        "checkpoint_s": ckpt_s,
        "export_hf_s": export_s,
        "resume_s": resume_s,
        "resume_exact": exact,
        "step_after_save_changed_state": moved_any,
        "hf_export_max_abs_diff": hf_diff,
        "dcp_bytes": bytes_on_disk,
    }


def run_world(a: argparse.Namespace, n: int, work: Path) -> list[dict[str, Any]]:
    out = work / f"ranks{n}.json"
    args = [
        "-m",
        "bench.trainer.fsdp_scaling",
        "--worker",
        "--model-path",
        str(a.model_path),
        "--save",
        str(work / f"save{n}"),
        "--out",
        str(out),
        "--steps",
        str(a.steps),
        "--precision",
        a.precision,
        "--groups",
        str(a.groups),
        "--group-size",
        str(a.group_size),
        "--prompt",
        str(a.prompt),
        "--completion",
        str(a.completion),
        "--micro-tokens",
        str(a.micro_tokens),
        "--device",
        a.device,
        *(["--checkpoint"] if a.checkpoint else []),
    ]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    pypath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": pypath}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    torchrun = n > 1 or a.device == "cuda"  # CUDA: NCCL and FSDP2 at world size 1 too
    argv = [sys.executable, *(launcher if torchrun else []), *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{n} ranks failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.fsdp_scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="tiny", help="tiny|small|base (bench/common.py)")
    ap.add_argument("--ranks", default="1,2", help="world sizes to compare")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=64, help="completion tokens")
    ap.add_argument("--micro-tokens", type=int, default=2560, help="--micro-batch-tokens")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL")
    ap.add_argument("--checkpoint", action="store_true", help="also time DCP save/resume/export")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per world size")
    ap.add_argument("--results", type=Path, default=RESULTS / "fsdp_scaling.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    a.model_path = model_dir(a.model)
    result: dict[str, Any] = {
        "machine": machine(),
        "config": {
            k: getattr(a, k)
            for k in (
                "steps",
                "precision",
                "groups",
                "group_size",
                "prompt",
                "completion",
                "micro_tokens",
                "threads",
                "device",
            )
        },
    }
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        for n in parse_list(a.ranks):
            rows = run_world(a, n, Path(tmp))
            result[f"ranks_{n}"] = {
                "per_rank": rows,
                "params_mib_per_rank": [r["params_bytes"] / 2**20 for r in rows],
                "optim_mib_per_rank": [r["optim_bytes"] / 2**20 for r in rows],
                "peak_rss_mib_per_rank": [r["peak_rss_bytes"] / 2**20 for r in rows],
                "step_s_median": statistics.median(rows[0]["step_s"]),
                "gather_s_median": statistics.median(rows[0]["gather_s"])
                if rows[0]["gather_s"]
                else 0.0,
            }
            if a.device == "cuda":
                result[f"ranks_{n}"]["cuda_peak_mib_per_rank"] = [
                    r["cuda_peak_bytes"] / 2**20 for r in rows
                ]
            print(
                n,
                "ranks:",
                {k: v for k, v in result[f"ranks_{n}"].items() if k != "per_rank"},
                flush=True,
            )
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    key = f"{a.model} threads={a.threads}" + (" cuda" if a.device == "cuda" else "")
    write_result(a.results, key, result)
    print(f"wrote {a.results} [{key}]")


if __name__ == "__main__":
    main()

"""Does NCCL accept two ranks on one GPU? (The trainer gives every rank its own GPU.)

    python -m bench.trainer.nccl_same_gpu [--ranks 2] [--timeout 90] [--out FILE]

Starts ``torchrun --standalone --nproc-per-node N`` ranks that all take ``cuda:0``, join an
NCCL process group and all-reduce one tensor. NCCL normally refuses this ("Duplicate GPU
detected"), which is why a sharded trainer needs one GPU per rank (docs/MULTINODE.md) and why
the bridge uses CUDA IPC, not NCCL, between processes on one GPU (docs/BRIDGE.md). The run
is bounded by ``--timeout`` (a refused communicator may also hang rather than fail); the
outcome (ok / refused / timed out, and the log's tail) goes to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from bench.common import REPO


def worker() -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)  # every rank on the same GPU, on purpose
    dist.init_process_group(
        "nccl", timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0)
    )
    t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"rank {dist.get_rank()}: all_reduce gave {t[0].item()}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.nccl_same_gpu", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default: stdout)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker()
        return
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.ranks}",
        "-m",
        "bench.trainer.nccl_same_gpu",
        "--worker",
    ]
    pypath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), "PYTHONPATH": pypath}
    # its own session, so a timeout stops every rank (torchrun's children included)
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=a.timeout)
        outcome = "ok" if proc.returncode == 0 else "refused"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log, _ = proc.communicate()
        outcome = "timed out"
    result = {
        "ranks": a.ranks,
        "outcome": outcome,
        "returncode": proc.returncode,
        "duplicate_gpu_message": "Duplicate GPU" in log,
        "log_tail": log[-4000:],
    }
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text if not a.out else f"{outcome}; wrote {a.out}")


if __name__ == "__main__":
    main()

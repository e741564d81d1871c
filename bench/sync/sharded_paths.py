"""Weight sync from N sharded trainer ranks: gather to rank 0, or per-rank sends?

    python -m bench.sync.sharded_paths [--model tiny|small|base] [--trainers 2,4]
        [--rounds 5] [--bucket-mib 0] [--backend gloo|nccl]

Starts ``torchrun --nproc-per-node N+1``: ranks 0..N-1 hold FSDP2-style dim-0 shards (padded
to equal rows, as FSDP2 pads) of every parameter of a real model folder (bench/common.py's
sizes, fp32 as the trainer's master weights), and rank N stands in for the inference worker.
Per bucket (``--bucket-mib``; 0 = one bucket for the whole model, the bridge's default), two
paths move the same weights into the receiver's full tensors:

- ``gather``: what the trainer does (trainer/dist_weights.py): one all-gather per parameter
  among the trainer ranks (the collective ``DTensor.full_tensor()`` issues), rank 0 copies the
  gathered tensors into a flat bucket, then broadcasts it to the receiver (the bridge's
  broadcast, over a group of rank 0 and the receiver);
- ``per_rank``: each trainer rank packs its own shards of the bucket into one flat buffer and
  sends it to the receiver, which receives from every rank and reassembles the full tensors.

Rounds alternate the two paths; each round is timed from a barrier to the receiver holding
every tensor (plus a closing barrier). The receiver checks both paths' tensors against the
expected weights once. Bytes moved are counted per path. Results:
``docs/results/sharded_sync_paths.json``, summarised in docs/results/fsdp_scaling.md (7b).
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
from typing import Any

from bench.common import REPO, RESULTS, machine, model_dir, parse_list, write_result


def param_shapes(model_path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the tensors in a model folder's safetensors files, in file order."""
    from safetensors import safe_open

    out = []
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                out.append((k, tuple(int(x) for x in st.get_slice(k).get_shape())))
    return out


def buckets(shapes: list, bucket_bytes: int, elem: int) -> list[list[int]]:
    """Parameter indices grouped in order into buckets of at most ``bucket_bytes`` (0: one)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(shapes):
        nbytes = elem * _numel(shape)
        if bucket_bytes and groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _full(i: int, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shapes = [(n, tuple(s)) for n, s in json.loads(Path(a.shapes).read_text())]
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    n, recv = world - 1, world - 1  # trainer count; the receiver's rank
    dev = torch.device("cpu")
    if a.backend == "nccl":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    trainers = dist.new_group(list(range(n)))
    pair = dist.new_group([0, recv])
    rows = [-(-s[0] // n) for _, s in shapes]  # FSDP2's padded rows per rank
    plan = buckets(shapes, a.bucket_mib << 20, elem)
    local: list[Any] = []
    if rank < n:  # this rank's padded shard of every parameter
        for i, (_, s) in enumerate(shapes):
            shard = torch.zeros((rows[i], *s[1:]), dtype=dtype, device=dev)
            part = _full(i, s, dtype, dev)[rank * rows[i] : (rank + 1) * rows[i]]
            shard[: part.shape[0]] = part
            local.append(shard)
    full = [torch.empty(s, dtype=dtype, device=dev) for _, s in shapes] if rank == recv else []

    def sync_gather() -> None:
        for b in plan:
            flat = torch.empty(sum(_numel(shapes[i][1]) for i in b), dtype=dtype, device=dev)
            if rank < n:
                off = 0
                for i in b:
                    out = torch.empty((rows[i] * n, *shapes[i][1][1:]), dtype=dtype, device=dev)
                    dist.all_gather_into_tensor(out, local[i], group=trainers)
                    k = _numel(shapes[i][1])
                    if rank == 0:
                        flat[off : off + k].copy_(out[: shapes[i][1][0]].reshape(-1))
                    off += k
            if rank in (0, recv):
                dist.broadcast(flat, src=0, group=pair)
            if rank == recv:
                off = 0
                for i in b:
                    k = _numel(shapes[i][1])
                    full[i].copy_(flat[off : off + k].view(shapes[i][1]))
                    off += k

    def sync_per_rank() -> None:
        for b in plan:
            per = [rows[i] * _numel(shapes[i][1][1:]) for i in b]  # shard elements
            if rank < n:
                flat = torch.cat([local[i].reshape(-1) for i in b])
                dist.send(flat, dst=recv)
                continue
            bufs = [torch.empty(sum(per), dtype=dtype, device=dev) for _ in range(n)]
            for w in [dist.irecv(bufs[r], src=r) for r in range(n)]:
                w.wait()
            for r in range(n):
                off = 0
                for j, i in enumerate(b):
                    s = shapes[i][1]
                    lo, hi = r * rows[i], min((r + 1) * rows[i], s[0])
                    if hi > lo:
                        sub = bufs[r][off : off + per[j]].view(rows[i], *s[1:])
                        full[i][lo:hi].copy_(sub[: hi - lo])
                    off += per[j]

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    paths = {"gather": sync_gather, "per_rank": sync_per_rank}
    times: dict[str, list[float]] = {k: [] for k in paths}
    exact: dict[str, bool] = {}
    for name, fn in paths.items():  # warm-up, then check the receiver's tensors
        timed(fn)
        if rank == recv:
            exact[name] = all(
                torch.equal(full[i], _full(i, s, dtype, dev)) for i, (_, s) in enumerate(shapes)
            )
            for t in full:
                t.zero_()
    for r in range(a.rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            times[name].append(timed(paths[name]))
    if rank == recv:
        Path(a.out).write_text(json.dumps({"times": times, "exact": exact, "buckets": len(plan)}))
    dist.destroy_process_group()


def bytes_moved(shapes: list, n: int, elem: int) -> dict[str, dict[str, int]]:
    """Bytes on the wire per path (padded shards, as FSDP2 holds them)."""
    model = elem * sum(_numel(s) for _, s in shapes)
    padded = elem * sum(-(-s[0] // n) * n * _numel(s[1:]) for _, s in shapes)
    return {
        "gather": {
            "total": (n - 1) * padded + model,  # every rank receives the others' shards
            "into_receiver": model,
            "out_of_rank0": padded // n * (n - 1) + model,
        },
        "per_rank": {"total": padded, "into_receiver": padded, "out_of_rank0": padded // n},
    }


def run_one(a: argparse.Namespace, n: int, shapes: list, work: Path) -> dict[str, Any]:
    spec = work / "shapes.json"
    spec.write_text(json.dumps(shapes))
    out = work / f"trainers{n}.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n + 1}",
        "-m",
        "bench.sync.sharded_paths",
        "--worker",
        "--shapes",
        str(spec),
        "--out",
        str(out),
        "--rounds",
        str(a.rounds),
        "--bucket-mib",
        str(a.bucket_mib),
        "--backend",
        a.backend,
        "--dtype",
        a.dtype,
    ]
    pypath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": pypath}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{n} trainers failed:\n{(done.stdout + done.stderr)[-3000:]}")
    got = json.loads(out.read_text())
    elem = 4 if a.dtype == "fp32" else 2
    moved = bytes_moved(shapes, n, elem)
    row: dict[str, Any] = {"buckets": got["buckets"], "exact": got["exact"]}
    for path, ts in got["times"].items():
        med = statistics.median(ts)
        row[path] = {
            "s": ts,
            "median_s": med,
            "min_s": min(ts),
            "max_s": max(ts),
            "bytes": moved[path],
            "into_receiver_mb_per_s": moved[path]["into_receiver"] / med / 1e6,
        }
    row["per_rank_vs_gather"] = row["per_rank"]["median_s"] / row["gather"]["median_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.sync.sharded_paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="tiny", help="tiny|small|base (bench/common.py)")
    ap.add_argument("--trainers", default="2", help="trainer world sizes, e.g. 2,4")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per path")
    ap.add_argument("--bucket-mib", type=int, default=0, help="0: one bucket (the bridge's)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    ap.add_argument("--results", type=Path, default=RESULTS / "sharded_sync_paths.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    shapes = param_shapes(model_dir(a.model))
    for n in parse_list(a.trainers):
        with tempfile.TemporaryDirectory(prefix="sync-paths-") as tmp:
            result = {"machine": machine(), "config": vars(a) | {"results": str(a.results)}}
            result["result"] = run_one(a, n, shapes, Path(tmp))
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        key = f"{a.model} trainers={n} {a.backend} {a.dtype} bucket_mib={a.bucket_mib}"
        write_result(a.results, key, result)
        r = result["result"]
        print(
            f"{key}: gather {r['gather']['median_s']:.4f} s, per_rank "
            f"{r['per_rank']['median_s']:.4f} s (x{r['per_rank_vs_gather']:.2f}), exact {r['exact']}",
            flush=True,
        )


if __name__ == "__main__":
    main()

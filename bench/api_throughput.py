"""Batching-API benchmark: ingest and serve throughput and latency on a real uvicorn server.

    python bench/api_throughput.py [--groups 2000] [--group-size 8] [--seq-len 512]

For each SQLite ``synchronous`` mode (FULL, NORMAL) start ``python -m api`` on a fresh
database, then: ingest -- ``--pushers`` threads each push groups one request at a time
(``--per-push`` groups per request, like an env service); serve -- one trainer leases batches
of ``--batch-sequences`` and acks each. Records groups/s, sequences/s and p50/p99 request
latency. Results: docs/results/api_bench.json (+ a table printed for docs/results/api_bench.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api.client import ApiClient  # noqa: E402
from launch.procs import ManagedProcess, free_port  # noqa: E402


def make_group(group_size: int, seq_len: int) -> dict:
    half = seq_len // 2
    seq = {"tokens": list(range(1000, 1000 + seq_len)), "mask": [0] * half + [1] * (seq_len - half),
           "logprobs": [-0.1234567] * seq_len, "score": 0.5,
           "spans": {"rationale": [0] * seq_len}}  # fmt: skip
    return {"group_id": uuid.uuid4().hex, "env": "bench", "policy_version": 0,
            "sequences": [seq] * group_size, "metrics": {"format": 0.5}}  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def run_mode(sync: str, args: argparse.Namespace, workdir: Path) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "api", "--port", str(port), "--synchronous", sync,
            "--db-path", str(workdir / f"{sync}.sqlite"), "--log-level", "warning"]  # fmt: skip
    proc = ManagedProcess("api", argv, workdir / f"{sync}.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=60)
        pushes = args.groups // args.per_push
        bodies = [[make_group(args.group_size, args.seq_len) for _ in range(args.per_push)]
                  for _ in range(pushes)]  # fmt: skip
        lat: list[float] = []
        lock = threading.Lock()

        def pusher(k: int) -> None:
            api = ApiClient(url, timeout=60)
            for body in bodies[k :: args.pushers]:
                t = time.perf_counter()
                api.push_groups(body)
                with lock:
                    lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=pusher, args=(k,)) for k in range(args.pushers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        ingest_s = time.perf_counter() - t0
        n_groups = pushes * args.per_push

        api = ApiClient(url, timeout=60)
        lease_lat: list[float] = []
        served = 0
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            lease = api.lease(
                max_sequences=args.batch_sequences, lease_seconds=60, allow_partial=True
            )
            if lease is None:
                break
            api.ack(lease.batch_id)
            lease_lat.append(time.perf_counter() - t)
            served += len(lease.groups)
        serve_s = time.perf_counter() - t0
        assert served == n_groups, (served, n_groups)
        seqs = n_groups * args.group_size
        return {
            "synchronous": sync,
            "ingest": {
                "groups_per_s": n_groups / ingest_s,
                "sequences_per_s": seqs / ingest_s,
                "request_p50_ms": 1e3 * pct(lat, 50),
                "request_p99_ms": 1e3 * pct(lat, 99),
                "requests": len(lat),
            },  # fmt: skip
            "serve": {
                "groups_per_s": served / serve_s,
                "sequences_per_s": seqs / serve_s,
                "lease_ack_p50_ms": 1e3 * pct(lease_lat, 50),
                "lease_ack_p99_ms": 1e3 * pct(lease_lat, 99),
                "batches": len(lease_lat),
            },  # fmt: skip
        }
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--per-push", type=int, default=4, help="groups per push request")
    ap.add_argument("--pushers", type=int, default=4, help="concurrent pushing threads")
    ap.add_argument("--batch-sequences", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "api_bench.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_mode(s, args, Path(tmp)) for s in ("FULL", "NORMAL")]
    report = {"machine": f"{platform.machine()}, {platform.processor() or '?'}",
              "params": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        "| synchronous | ingest groups/s | ingest seq/s | push p50 / p99 ms | serve groups/s "
        "| serve seq/s | lease+ack p50 / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        i, s = r["ingest"], r["serve"]
        print(f"| {r['synchronous']} | {i['groups_per_s']:.0f} | {i['sequences_per_s']:.0f} | "
              f"{i['request_p50_ms']:.1f} / {i['request_p99_ms']:.1f} | {s['groups_per_s']:.0f} | "
              f"{s['sequences_per_s']:.0f} | {s['lease_ack_p50_ms']:.1f} / {s['lease_ack_p99_ms']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()

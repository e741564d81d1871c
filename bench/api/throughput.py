"""Batching-API benchmark: ingest and serve throughput and latency, ours vs Atropos's own API.

    flock /tmp/heavy.lock .venv/bin/python -m bench.api.throughput [--target both]
        [--group-sizes 8] [--batch-sizes 64] [--sequences 6144] [--seq-len 512]

Targets (each a real uvicorn server on a free port, fresh state per point):

- ``atropos``: atroposlib's ``run-api`` (PyPI ``atroposlib==0.4.0``, in-memory queue), run
  from its own virtualenv (``--atropos-python``; created with pip on first use under
  ``artifacts/venvs/atropos`` so the project's pinned venv is untouched). Driven through its
  routes: ``POST /scored_data_list`` to ingest, ``GET /batch`` to serve.
- ``ours-atropos``: our API (``python -m api``, SQLite WAL, ``--synchronous FULL``) driven with
  the *same request bodies* on its Atropos-compatible routes (``/scored_data_list``, ``/batch``).
- ``ours-native``: our API on its native routes with the same content in the native contract
  (``POST /groups``; ``POST /batches/lease`` + ``POST /batches/{id}/ack``).

Payload: groups of ``group size`` sequences of ``--seq-len`` tokens (half prompt, half
completion: Atropos ``masks`` = labels with -100 on the prompt, ``inference_logprobs``), every
group distinct. Bodies are built and gzip-compressed before the clock starts (atroposlib's env
client gzips too) and posted by ``--pushers`` threads, ``--per-push`` groups per request.
Serve: one trainer asks for batches of ``batch size`` sequences until the queue is empty.
``--target both`` runs all three. Results are merged into docs/results/api_compare.json under
``<target>/gs<G>/b<B>``; the machine and load are recorded with each point. The parts:
bench/api/bodies.py (payloads), bench/api/servers.py (the targets),
bench/api/points.py (one point).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.api.bodies import encode_bodies
from bench.api.points import run_point, status_env_point
from bench.api.servers import ATROPOS_VENV, ensure_atropos
from bench.common import (
    RESULTS,
    machine,
    parse_list,
    stop_on_sigterm,
    write_result,
)

TARGETS = ("atropos", "ours-atropos", "ours-native")


def profile_ingest(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """Where the Atropos-route ingest time goes, stage by stage, in this process: ms per
    request body of ``--per-push`` groups (``--group-sizes``' first x ``--seq-len``), the
    median of 9 rounds of 10 calls."""
    import msgspec

    from api import atropos_wire
    from api.store import Row, Store

    gs = parse_list(args.group_sizes)[0]
    body = encode_bodies("atropos", args.per_push, gs, args.seq_len, args.per_push)[0]
    raw = gzip.decompress(body)
    store = Store(work / "profile.sqlite", synchronous=args.synchronous)
    n = [0]

    def commit() -> None:
        n[0] += 1
        store.ingest_rows(
            [
                Row(f"{n[0]}-{p.group_id}", None, None, p.n_seqs, p.n_tokens, p.payload, "atropos")
                for p in prepared
            ]
        )

    items = atropos_wire.split_body(raw)
    prepared = [atropos_wire.prepare(i, "reject") for i in items]
    decoded = [atropos_wire._decode_item.decode(i) for i in items]
    raws = [bytes(i) for i in items]
    stages = {
        "gunzip": lambda: gzip.decompress(body),
        "split the list (msgspec)": lambda: atropos_wire.split_body(raw),
        "typed decode + checks + payload + hash": lambda: [
            atropos_wire.prepare(i, "reject") for i in items
        ],
        "  typed decode (msgspec)": lambda: [atropos_wire._decode_item.decode(i) for i in items],
        "  hash of the posted bytes (sha256)": lambda: [hashlib.sha256(r).digest() for r in raws],
        "  for scale: encoding again (avoided)": lambda: [
            atropos_wire._encoder.encode(g) for g in decoded
        ],
        "  for scale: json.loads": lambda: json.loads(raw),
        "  for scale: msgspec untyped": lambda: msgspec.json.decode(raw),
        f"SQLite insert + commit ({args.synchronous})": commit,
    }
    out = {}
    for name, fn in stages.items():  # median of 9 rounds of 10 calls: load spikes hit rounds
        fn()
        rounds = []
        for _ in range(9):
            t = time.perf_counter()
            for _ in range(10):
                fn()
            rounds.append(1e3 * (time.perf_counter() - t) / 10)
        out[name] = statistics.median(rounds)
        print(f"{name:42s} {out[name]:7.2f} ms", flush=True)
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.api.throughput",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "--target",
        choices=[*TARGETS, "ours", "both"],
        default="both",
        help="ours = ours-atropos + ours-native; both = all three",
    )
    ap.add_argument("--group-sizes", default="8", help="comma list, e.g. 4,8,16")
    ap.add_argument("--batch-sizes", default="64", help="sequences per served batch, comma list")
    ap.add_argument("--sequences", type=int, default=6144, help="sequences ingested per point")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--per-push", type=int, default=4, help="groups per push request")
    ap.add_argument("--pushers", type=int, default=4, help="concurrent pushing threads")
    ap.add_argument(
        "--synchronous",
        choices=["FULL", "NORMAL"],
        default="FULL",
        help="our API's SQLite synchronous mode (FULL = fsync per commit, default)",
    )
    ap.add_argument(
        "--atropos-python",
        type=Path,
        default=None,
        help=f"python of a venv with atroposlib (default: {ATROPOS_VENV}, created)",
    )
    ap.add_argument("--profile", action="store_true", help="instead: ingest cost by stage")
    ap.add_argument(
        "--status-env-history",
        default="",
        help="instead: /status-env latency after this many groups served, comma list",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "api_compare.json")
    args = ap.parse_args()
    stop_on_sigterm()
    targets = {"both": TARGETS, "ours": TARGETS[1:]}.get(args.target, (args.target,))
    if "atropos" in targets:
        args.atropos_python = ensure_atropos(args.atropos_python)
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            r = {
                "stages_ms": profile_ingest(args, Path(tmp)),
                "per_push": args.per_push,
                "seq_len": args.seq_len,
                "machine": machine(),
            }
        write_result(args.out, "profile/ours-atropos", r)
        return
    if args.status_env_history:
        with tempfile.TemporaryDirectory() as tmp:
            for history in parse_list(args.status_env_history):
                for target in (t for t in targets if t != "ours-native"):
                    r = status_env_point(target, history, args, Path(tmp))
                    write_result(args.out, f"status-env/{target}/h{history}", r)
                    print(
                        f"{target} history {history}: /status-env p50 {r['p50_ms']:.1f} ms, "
                        f"p99 {r['p99_ms']:.1f} ms",
                        flush=True,
                    )
        return
    print(
        "| target | gs | batch | ingest seq/s | push p50/p99 ms | serve seq/s | batch p50/p99 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for gs in parse_list(args.group_sizes):
            for batch in parse_list(args.batch_sizes):
                for target in targets:
                    r = run_point(target, gs, batch, args, Path(tmp))
                    key = f"{target}/gs{gs}/b{batch}"
                    if args.synchronous != "FULL" and target != "atropos":
                        key += f"/{args.synchronous}"
                    write_result(args.out, key, r)
                    i, s = r["ingest"], r["serve"]
                    print(
                        f"| {target} | {gs} | {batch} | {i['sequences_per_s']:.0f} | "
                        f"{i['p50_ms']:.1f} / {i['p99_ms']:.1f} | {s['sequences_per_s']:.0f} | "
                        f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

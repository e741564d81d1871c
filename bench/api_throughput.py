"""Batching-API benchmark: ingest and serve throughput and latency, ours vs Atropos's own API.

    flock /tmp/heavy.lock .venv/bin/python bench/api_throughput.py [--target both]
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
``<target>/gs<G>/b<B>``; the machine and load are recorded with each point.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    RESULTS,
    machine,
    parse_list,
    pct,
    stop_on_sigterm,
    write_result,
)
from launch.procs import ManagedProcess  # noqa: E402
from settings.paths import ARTIFACTS  # noqa: E402
from settings.ports import free_port  # noqa: E402

ATROPOS_VERSION = "0.4.0"
ATROPOS_VENV = ARTIFACTS / "venvs" / "atropos"
TARGETS = ("atropos", "ours-atropos", "ours-native")


def atropos_group(g: int, group_size: int, seq_len: int) -> dict[str, Any]:
    """One group in Atropos's ``ScoredData`` shape; ``g`` makes its content unique."""
    half = seq_len // 2
    tokens, masks = [], []
    for s in range(group_size):
        toks = [g % 4096, s] + [1000 + (j % 3000) for j in range(seq_len - 2)]
        tokens.append(toks)
        masks.append([-100] * half + toks[half:])
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [0.5] * group_size,
        "inference_logprobs": [[-0.1234567] * seq_len for _ in range(group_size)],
    }


def native_group(g: int, group_size: int, seq_len: int) -> dict[str, Any]:
    """The same content as ``atropos_group`` in the native data contract."""
    a = atropos_group(g, group_size, seq_len)
    seqs = [
        {"tokens": t, "mask": [0 if m == -100 else 1 for m in mk], "logprobs": lp, "score": sc}
        for t, mk, lp, sc in zip(
            a["tokens"], a["masks"], a["inference_logprobs"], a["scores"], strict=True
        )
    ]
    return {"group_id": f"bench-{g}", "env": "bench", "policy_version": 0, "sequences": seqs}


def encode_bodies(
    target: str, n_groups: int, group_size: int, seq_len: int, per_push: int
) -> list[bytes]:
    """Gzip-compressed request bodies, ``per_push`` groups each."""
    make = native_group if target == "ours-native" else atropos_group
    bodies = []
    for start in range(0, n_groups, per_push):
        groups = [
            make(g, group_size, seq_len) for g in range(start, min(n_groups, start + per_push))
        ]
        payload = {"groups": groups} if target == "ours-native" else groups
        bodies.append(gzip.compress(json.dumps(payload).encode(), compresslevel=1))
    return bodies


def ensure_atropos(python: Path | None = None) -> Path:
    """The Python of a virtualenv with atroposlib (created with pip from PyPI if missing,
    under ``$SHOP_R1_ARTIFACTS/venvs/atropos``; a file lock lets parallel test workers share
    one build)."""
    if python is not None:
        return python
    py = ATROPOS_VENV / "bin" / "python"
    check = [
        str(py),
        "-c",
        f"import atroposlib.api; import importlib.metadata as m; "
        f"assert m.version('atroposlib') == '{ATROPOS_VERSION}'",
    ]
    ATROPOS_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(ATROPOS_VENV.parent / "atropos.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
            return py
        base = Path(getattr(sys, "_base_executable", sys.executable))
        subprocess.run([str(base), "-m", "venv", "--clear", str(ATROPOS_VENV)], check=True)
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", f"atroposlib=={ATROPOS_VERSION}"], check=True
        )
    return py


def start_server(target: str, work: Path, args: argparse.Namespace) -> tuple[ManagedProcess, str]:
    port = free_port()
    if target == "atropos":
        argv = [
            str(args.atropos_python),
            "-m",
            "uvicorn",
            "atroposlib.api:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
    else:
        argv = [
            sys.executable,
            "-m",
            "api",
            "--port",
            str(port),
            "--synchronous",
            args.synchronous,
            "--db-path",
            str(work / f"{target}-{port}.sqlite"),
            "--log-level",
            "warning",
            "--max-body-bytes",
            str(1 << 30),
        ]
    proc = ManagedProcess(target, argv, work / f"{target}-{port}.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + ("/" if target == "atropos" else "/health"), timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def ingest(url: str, target: str, bodies: list[bytes], pushers: int) -> tuple[float, list[float]]:
    """Post every body (``pushers`` threads). Returns wall seconds and per-request latencies."""
    import httpx

    path = "/groups" if target == "ours-native" else "/scored_data_list"
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    lat: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []

    def pusher(k: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            for body in bodies[k::pushers]:
                t = time.perf_counter()
                r = client.post(path, content=body, headers=headers)
                dt = time.perf_counter() - t
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    return
                with lock:
                    lat.append(dt)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(pushers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{target} ingest failed: {errors[0]}")
    return time.perf_counter() - t0, lat


def serve(url: str, target: str, batch: int) -> tuple[float, list[float], int]:
    """Ask for batches until none is left. Returns wall seconds, latencies, sequences served."""
    import httpx

    lat: list[float] = []
    served = 0
    with httpx.Client(base_url=url, timeout=300) as client:
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            if target == "ours-native":
                r = client.post(
                    "/batches/lease", json={"max_sequences": batch, "lease_seconds": 600}
                )
                if r.status_code == 204:
                    break
                r.raise_for_status()
                lease = r.json()
                client.post(f"/batches/{lease['batch_id']}/ack").raise_for_status()
                n = sum(len(g["sequences"]) for g in lease["groups"])
            else:
                r = client.get("/batch")
                r.raise_for_status()
                groups = r.json().get("batch")
                if not groups:
                    break
                n = sum(len(g["tokens"]) for g in groups)
            lat.append(time.perf_counter() - t)
            served += n
        wall = time.perf_counter() - t0
    return wall, lat, served


def register(url: str, target: str, batch: int) -> None:
    import httpx

    if target != "ours-native":
        body = {
            "wandb_group": "bench",
            "wandb_project": "bench",
            "batch_size": batch,
            "max_token_len": 4096,
            "checkpoint_dir": "",
            "save_checkpoint_interval": -1,
            "starting_step": 0,
            "num_steps": 1000,
        }
        httpx.post(url + "/register", json=body, timeout=30).raise_for_status()


def run_point(target: str, gs: int, batch: int, args: argparse.Namespace, work: Path) -> dict:
    n_groups = args.sequences // gs
    bodies = encode_bodies(target, n_groups, gs, args.seq_len, args.per_push)
    proc, url = start_server(target, work, args)
    try:
        register(url, target, batch)
        ingest_s, push_lat = ingest(url, target, bodies, args.pushers)
        serve_s, serve_lat, served = serve(url, target, batch)
    finally:
        proc.stop()
    seqs = n_groups * gs
    if served != seqs:
        raise RuntimeError(f"{target}: served {served} of {seqs} sequences")
    return {
        "target": target,
        "group_size": gs,
        "batch_sequences": batch,
        "groups": n_groups,
        "sequences": seqs,
        "seq_len": args.seq_len,
        "per_push": args.per_push,
        "pushers": args.pushers,
        "body_kib_gzip": sum(map(len, bodies)) / len(bodies) / 1024,
        "synchronous": None if target == "atropos" else args.synchronous,
        "ingest": {
            "groups_per_s": n_groups / ingest_s,
            "sequences_per_s": seqs / ingest_s,
            "p50_ms": 1e3 * pct(push_lat, 50),
            "p99_ms": 1e3 * pct(push_lat, 99),
            "requests": len(push_lat),
        },
        "serve": {
            "groups_per_s": n_groups / serve_s,
            "sequences_per_s": seqs / serve_s,
            "p50_ms": 1e3 * pct(serve_lat, 50),
            "p99_ms": 1e3 * pct(serve_lat, 99),
            "max_ms": 1e3 * max(serve_lat),
            "batches": len(serve_lat),
        },
        "machine": machine(),
    }


def status_env_point(target: str, history: int, args: argparse.Namespace, work: Path) -> dict:
    """``/status-env`` latency (300 sequential calls, as a ``BaseEnv`` polls it) after
    ``history`` groups (8 x 16 tokens) were posted and served through the Atropos routes."""
    import httpx

    bodies = encode_bodies("atropos", history, 8, 16, 64)
    proc, url = start_server(target, work, args)
    try:
        register(url, target, 64)
        with httpx.Client(base_url=url, timeout=120) as c:
            c.get("/batch").raise_for_status()  # the trainer has started
            env = {
                "max_token_length": 4096,
                "desired_name": "bench",
                "weight": 1.0,
                "group_size": 8,
            }
            eid = c.post("/register-env", json=env).json()["env_id"]
            ingest(url, target, bodies, args.pushers)
            serve(url, target, 64)
            lat = []
            for _ in range(300):
                t = time.perf_counter()
                c.request("GET", "/status-env", json={"env_id": eid}).raise_for_status()
                lat.append(time.perf_counter() - t)
    finally:
        proc.stop()
    return {
        "target": target,
        "history_groups": history,
        "p50_ms": 1e3 * pct(lat, 50),
        "p99_ms": 1e3 * pct(lat, 99),
        "machine": machine(),
    }


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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

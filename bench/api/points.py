"""One measured point of ``bench/api/throughput.py``: push the bodies, serve the batches, and
the ``/status-env`` latency (docs/results/api_throughput.md).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from bench.api.bodies import encode_bodies
from bench.api.servers import start_server
from bench.common import machine, pct


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

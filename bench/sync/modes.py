"""The modes ``bench/sync/bridge_sync.py`` measures and one mode's rounds on a real patched vLLM
server (docs/BRIDGE.md, docs/results/weight_sync.md).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.sync.probes import FreezeProbe, StreamWatch, apply_floor, major_faults, steal_s

MODES: list[tuple[str, str, dict, dict]] = [
    # key, label, bridge kwargs (bench.sync.variants.bench_bridge), start_bridge_server kwargs
    ("broadcast", "broadcast (gloo + same-host shm)", {"mode": "shared_vllm"}, {}),
    (
        "broadcast_copy",
        "broadcast, packing copy (not resident)",
        {"mode": "shared_vllm", "resident": False},
        {},
    ),
    (
        "broadcast_tcp",
        "broadcast (gloo, loopback TCP)",
        {"mode": "shared_vllm", "shm_fast_path": False},
        {},
    ),
    (
        "single_copy",
        "single-copy (shm)",
        {"mode": "shared_vllm", "single_copy": True},
        {"single_copy": True},
    ),
    ("lora", "LoRA hot-swap", {"mode": "lora_only"}, {}),
    ("reload", "checkpoint reload", {"mode": "none"}, {}),
    ("restart", "server restart (Atropos legacy)", {"mode": "none", "restart": True}, {}),
]
FULL_WEIGHT = ("broadcast", "broadcast_copy", "broadcast_tcp", "single_copy")
"""The modes that move every weight through the bridge's data plane."""
RESTART_ROUNDS = 2
"""Default restart rounds (``--restart-rounds``): ~30 s each on this box; no warm-up round
(nothing persists across a restart)."""

TOKEN = "bench"


def _breakdown(stats, mode: str) -> dict:
    """Flatten one sync's timings (trainer phases, server route, worker) into one row."""
    detail = stats.detail
    row: dict = {"sync_s": stats.total_s, "bytes": stats.bytes}
    servers = detail.get("servers") or [{}]
    row["server_pause_s"] = max(float(a.get("stall_s", 0.0)) for a in servers)
    if mode != "shared_vllm":
        row.update(pack_s=stats.pack_s, transfer_s=stats.transfer_s)
        return row
    phases = detail.get("phases", {})
    answer = servers[0].get("detail", {})
    worker = (answer.get("workers") or [{}])[0]
    row.update(
        {k: phases.get(k) for k in ("check_s", "pack_s", "stage_call_s", "send_s", "apply_call_s")}
    )
    # pause_s there is entering the pause (incl. the KV/prefix-cache reset); the whole pause
    # (the stall) is server_pause_s above
    row["server_pause_enter_s"] = answer.get("pause_s")
    row.update({f"server_{k}": answer.get(k) for k in ("apply_rpc_s", "version_s", "resume_s")})
    row.update(
        {
            f"worker_{k}": worker.get(k)
            for k in ("stage_s", "wait_s", "apply_s", "load_s", "finalize_s", "lm_head_s")
        }
    )
    row["path"] = worker.get("path")
    # bytes in the worker's memory: the pack copy + the send + what the apply still waited for
    row["transfer_s"] = (
        (phases.get("pack_s") or 0) + (phases.get("send_s") or 0) + (worker.get("wait_s") or 0)
    )
    return row


def server_groups(keys: list[str]) -> list[list[str]]:
    """Modes that can share one server run, in order (a vLLM start is ~30 s on this box):
    both broadcast variants (each bridge sets up a fresh transfer group), and reload then
    restart (the restart replaces the server anyway)."""
    groups: list[list[str]] = []
    for key in keys:
        kw = next(m for m in MODES if m[0] == key)[3]
        mode = next(m for m in MODES if m[0] == key)[2]["mode"]
        last = groups[-1][-1] if groups else None
        if last is not None:
            lm = next(m for m in MODES if m[0] == last)
            if lm[2]["mode"] == mode and lm[3] == kw and last != "restart":
                groups[-1].append(key)
                continue
        groups.append([key])
    return groups


def bench_group(
    model_dir: Path,
    keys: list[str],
    rounds: int,
    work: Path,
    floor: bool,
    restart_rounds: int = RESTART_ROUNDS,
    on_result: Callable[[dict], None] | None = None,
) -> list:
    """Start one server for ``keys`` (see ``server_groups``), bench each mode (handing each
    result to ``on_result`` as soon as it is there), stop it."""
    from launch.vllm_server import start_bridge_server

    _, _, bridge_kw, server_kw = next(m for m in MODES if m[0] == keys[0])
    log = work / f"{model_dir.name}-{'+'.join(keys)}.log"
    # a one-element holder: the restart mode replaces the server process (stopped below)
    holder = [start_bridge_server(model_dir, bridge_kw["mode"], log, token=TOKEN, **server_kw)]
    out = []
    try:
        for i, key in enumerate(keys):
            label = next(m[1] for m in MODES if m[0] == key)
            print(f"[bench] {model_dir.name} {label} ...", flush=True)
            r = bench_mode(model_dir, key, rounds, work, floor and i == 0, holder, restart_rounds)
            r.update(key=key, label=label)
            print(f"[bench] {model_dir.name} {label}: {json.dumps(r['median'])}", flush=True)
            out.append(r)
            if on_result is not None:
                on_result(r)
    finally:
        holder[0].stop()
    return out


def bench_mode(
    model_dir: Path,
    key: str,
    rounds: int,
    work: Path,
    floor: bool,
    holder: list,
    restart_rounds: int = RESTART_ROUNDS,
) -> dict:
    """Rounds of one mode on the running server ``holder[0]`` (which the restart mode
    replaces with the new process, also when a round fails)."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.sync.variants import bench_bridge

    _, _, bridge_kw, _ = next(m for m in MODES if m[0] == key)
    bridge_kw = dict(bridge_kw)
    mode = bridge_kw.pop("mode")
    token = TOKEN
    result: dict = {}
    server = holder[0]
    if floor:
        result["apply_floor"] = apply_floor(server.base_url, token, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(model_dir)("Click the search button")["input_ids"]
    if mode == "lora_only":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    if mode in ("lora_only", "none"):
        bridge_kw["save_dir"] = work / f"{model_dir.name}-{key}"
    if key == "restart":
        bridge_kw["server"] = server
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.tensor([ids])
    rows = []
    n_rounds = restart_rounds if key == "restart" else rounds + 1  # + warm-up round
    bridge = bench_bridge(mode, server.base_url, token, bridge_kw)
    freeze = FreezeProbe()
    try:
        for version in range(1, n_rounds + 1):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            served = getattr(bridge, "served_model", None) or server.served_model_name
            # Long enough to still be decoding when the sync starts, even when an idle
            # box decodes the tiny model at ~1 ms/token.
            watch = StreamWatch(server.base_url, served, ids, n=2000)
            watch.wait_streaming()
            time.sleep(0.1)
            freeze.reset()
            faults0, steal0, t0 = major_faults(), steal_s(), time.perf_counter()
            stats = bridge.sync(model, version)
            t1, steal1, faults1 = time.perf_counter(), steal_s(), major_faults()
            if key == "restart":
                server = holder[0] = bridge.server  # the new process
            gap, median_gap = watch.gap_during(t0, t1)
            row = {
                "version": version,
                **_breakdown(stats, mode),
                "client_gap_s": gap,
                "median_token_gap_s": median_gap,
                "steal_s": steal1 - steal0,
                "major_faults": faults1 - faults0,
                "box_freeze_s": freeze.largest(),
            }
            if key == "restart":
                # no tokens at all while the server is down: the stall is the restart
                row["client_gap_s"] = row["server_pause_s"]
            rows.append(row)
    finally:
        if key == "restart":
            holder[0] = bridge.server
        bridge.close()
        freeze.close()
    served_now = httpx.get(f"{server.base_url}/bridge/health").json()["weight_version"]
    assert served_now == str(n_rounds), (served_now, n_rounds)
    steady = rows if key == "restart" else rows[1:]
    keys = [k for k in steady[0] if k not in ("version", "path")]
    result["median"] = {k: median_of([r[k] for r in steady]) for k in keys}
    result["best"] = {k: min_of([r[k] for r in steady]) for k in keys}
    result["rounds"] = rows
    result["params"] = sum(p.numel() for p in model.parameters())
    result["path"] = steady[-1].get("path")
    return result


def median_of(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def min_of(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def keys_order(key: str) -> int:
    return [m[0] for m in MODES].index(key)

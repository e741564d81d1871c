"""Weight-bridge benchmark: sync latency and generation stall per mode, vs a memcpy floor.

    python bench/bridge_sync.py [--big] [--rounds 5]

For each model (the embedded tiny model; with ``--big`` also a ~130M-parameter Qwen2 with
the same tokenizer) and each mode, start a real patched vLLM server on CPU, then per round:
a real optimizer step on the trainer's model, ``sync`` while a streaming completion runs,
and record the sync time, the server-side pause, and the largest gap between streamed tokens
during the sync (the stall a client actually sees). The floor is an in-memory copy of the
same number of bytes on this machine. Results: docs/results/bridge_bench.json and
docs/bridge_sync.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = [
    ("shared_vllm", False, "broadcast (gloo)"),
    ("shared_vllm", True, "single-copy (shm)"),
    ("lora_only", False, "LoRA hot-swap"),
    ("none", False, "checkpoint reload"),
]


def build_big_model(tiny_dir: Path, out: Path) -> Path:
    """~130M-parameter Qwen2 (random weights) sharing the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if (out / "model.safetensors").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=768, intermediate_size=2048, num_hidden_layers=20,
        num_attention_heads=12, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def memcpy_floor(nbytes: int, repeats: int = 5) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StreamWatch:
    """A streaming completion; records token arrival times to measure the stall.

    It stops reading (closing the stream, so vLLM aborts the request) half a second after
    the sync ended, so a slow model does not keep the benchmark waiting.
    """

    def __init__(self, url: str, model: str, ids: list[int], n: int) -> None:
        self.times: list[float] = []
        self.stop_at = float("inf")

        def run() -> None:
            import httpx

            body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.perf_counter())
                        if self.times[-1] > self.stop_at:
                            break

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def gap_during(self, t0: float, t1: float) -> tuple[float | None, float]:
        """(largest inter-token gap overlapping [t0, t1], median gap overall)."""
        self.stop_at = t1 + 0.5
        self.thread.join(600)
        gaps = [(b - a, a, b) for a, b in zip(self.times, self.times[1:], strict=False)]
        # Several SSE lines can arrive in one read; the step time is the typical real gap.
        steps = [g for g, _, _ in gaps if g > 5e-4]
        median = statistics.median(steps) if steps else 0.0
        during = [g for g, a, b in gaps if b >= t0 and a <= t1]
        if not during or self.times[0] > t0 or self.times[-1] < t1:
            return None, median  # the stream did not span the sync: no measurement
        return max(during), median


def bench_mode(model_dir: Path, mode: str, single: bool, rounds: int, work: Path) -> dict:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.bridge import make_bridge
    from vllm_patching.launcher import start_bridge_server

    token = "bench"
    log = work / f"{model_dir.name}-{mode}-{int(single)}.log"
    server = start_bridge_server(model_dir, mode, log, token=token, single_copy=single)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ids = AutoTokenizer.from_pretrained(model_dir)("Click the search button")["input_ids"]
        kwargs: dict = {}
        if mode == "lora_only":
            from peft import LoraConfig, get_peft_model

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        if mode in ("lora_only", "none"):
            kwargs["save_dir"] = work / f"{model_dir.name}-{mode}"
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        x = torch.tensor([ids])
        rows = []
        with make_bridge(
            mode, [server.base_url], single_copy=single, token=token, **kwargs
        ) as bridge:
            for version in range(1, rounds + 2):  # round 1 is the warm-up (init, allocation)
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                served = getattr(bridge, "served_model", None) or server.served_model_name
                # Long enough to still be decoding when the sync starts, even when an idle
                # box decodes the tiny model at ~1 ms/token.
                watch = StreamWatch(server.base_url, served, ids, n=2000)
                time.sleep(0.2)
                t0 = time.perf_counter()
                stats = bridge.sync(model, version)
                t1 = time.perf_counter()
                gap, median_gap = watch.gap_during(t0, t1)
                server_stall = max(
                    float(a.get("stall_s", 0.0)) for a in stats.detail.get("servers", [{}])
                )
                rows.append(
                    {"version": version, "sync_s": stats.total_s, "pack_s": stats.pack_s,
                     "transfer_s": stats.transfer_s, "server_pause_s": server_stall,
                     "client_gap_s": gap, "median_token_gap_s": median_gap, "bytes": stats.bytes}
                )  # fmt: skip
        assert httpx.get(f"{server.base_url}/bridge/health").json()["weight_version"] == str(
            rounds + 1
        )
    finally:
        server.stop()
    steady = rows[1:]
    med = {
        k: statistics.median(vals) if (vals := [r[k] for r in steady if r[k] is not None]) else None
        for k in steady[0]
        if k != "version"
    }
    nparams = sum(p.numel() for p in model.parameters())
    return {"rounds": rows, "median": med, "params": nparams}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        res = results[name]
        labels = [m["label"] for m in res["modes"]]
        best = [min(r["sync_s"] for r in m["rounds"][1:]) * 1e3 for m in res["modes"]]
        sync = [m["median"]["sync_s"] * 1e3 for m in res["modes"]]
        pause = [m["median"]["server_pause_s"] * 1e3 for m in res["modes"]]
        xs = range(len(labels))
        ax.bar([x - 0.27 for x in xs], best, 0.27, label="sync latency (best)")
        ax.bar(list(xs), sync, 0.27, label="sync latency (median, shared box)")
        ax.bar([x + 0.27 for x in xs], pause, 0.27, label="server pause = stall (median)")
        ax.axhline(res["memcpy_s"] * 1e3, color="k", ls="--", label="memcpy of the weights")
        ax.set_xticks(list(xs), labels, rotation=15)
        ax.set_ylabel("ms (log)")
        ax.set_yscale("log")
        ax.set_title(f"{name} ({res['params'] / 1e6:.0f}M params, {res['bytes'] / 2**20:.0f} MiB)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--big", action="store_true", help="also the ~130M-parameter model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=["tiny", "qwen2-130m"], help="re-measure one model, merge")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "bridge_bench.json")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "bridge_sync.png")
    args = ap.parse_args()

    from launch.paths import ARTIFACTS, TINY_MODEL_DIR
    from trainer.tiny_model import build_tiny_model, is_built

    if not is_built(TINY_MODEL_DIR):
        build_tiny_model(TINY_MODEL_DIR)
    models = {"tiny": TINY_MODEL_DIR}
    if args.big:
        models["qwen2-130m"] = build_big_model(
            TINY_MODEL_DIR, ARTIFACTS / "models" / "bench-qwen2-130m"
        )
    if args.only:
        models = {args.only: models[args.only]} if args.only in models else {}
        if not models:
            ap.error("--only qwen2-130m needs --big")
    work = ARTIFACTS / "bench" / "bridge"
    work.mkdir(parents=True, exist_ok=True)
    results: dict = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    for name, model_dir in models.items():
        entry: dict = {"modes": []}
        for mode, single, label in MODES:
            print(f"[bench] {name} {label} ...", flush=True)
            r = bench_mode(model_dir, mode, single, args.rounds, work)
            r.update(mode=mode, single_copy=single, label=label)
            entry["modes"].append(r)
            print(f"[bench] {name} {label}: {json.dumps(r['median'])}", flush=True)
        full = next(m for m in entry["modes"] if m["mode"] == "shared_vllm")
        entry["params"] = full["params"]
        entry["bytes"] = full["median"]["bytes"]
        entry["memcpy_s"] = memcpy_floor(int(entry["bytes"]))
        results[name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(f"[bench] wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()

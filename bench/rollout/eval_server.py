"""The evaluation's vLLM server: its dtype and its threads, on the same rows.

    flock /tmp/heavy.lock .venv/bin/python -m bench.rollout.eval_server \\
        --model artifacts/models/smollm2-135m-instruct-sft --configs float32:1,bfloat16:1,float32:2,bfloat16:2

Each config (``DTYPE:THREADS``) starts its own server (``launch.vllm_server``, bridge mode
none), its OpenMP threads pinned to the last THREADS cores (``VLLM_CPU_OMP_THREADS_BIND``, as
``launch/threads.py`` pins them), then ``python -m env_server.evaluate`` asks it the same rows
greedily as the launcher does. Per config: the server's start time, the evaluation's wall
time, its metrics, and how many answers are the same text as the first config's (a dtype
changes greedy answers where two tokens are close). Run on the validation split by default:
nothing is chosen on test rows. Results: docs/results/eval_server.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine, stop_on_sigterm

KEYS = ("exact_match", "mean_reward", "format_rate", "type_accuracy")


def parse_configs(text: str) -> list[tuple[str, int]]:
    """``"float32:1,bfloat16:2"`` -> ``[("float32", 1), ("bfloat16", 2)]``."""
    out = []
    for part in text.split(","):
        dtype, _, threads = part.strip().partition(":")
        if dtype not in ("float32", "bfloat16") or not threads.isdigit() or int(threads) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected float32|bfloat16:THREADS")
        out.append((dtype, int(threads)))
    return out


def server_threads(threads: int) -> dict[str, str]:
    """The OpenMP threads of a server pinned to the last ``threads`` cores of this process."""
    from launch.threads import available_cores, pinned_server

    cores = available_cores()
    if threads > len(cores):
        raise SystemExit(f"{threads} threads asked, {len(cores)} cores here")
    return pinned_server(cores[-threads:])


def completions(path: Path) -> list[str]:
    return [json.loads(line)["completion"] for line in path.read_text().splitlines() if line]


def main() -> None:
    from launch.threads import light_env
    from launch.vllm_server import server_env, start_bridge_server

    ap = argparse.ArgumentParser(
        "python -m bench.rollout.eval_server",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="served model (and tokenizer)")
    ap.add_argument("--configs", type=parse_configs, default="float32:1,bfloat16:1")
    ap.add_argument("--split", default="validation", choices=("validation", "test"))
    ap.add_argument("--rows", type=int, default=128, help="the split's first rows")
    ap.add_argument("--max-prompt-tokens", type=int, default=896, help="cpu-smol's")
    ap.add_argument("--max-tokens", type=int, default=128, help="cpu-smol's")
    ap.add_argument("--out", type=Path, default=RESULTS / "eval_server.json")
    a = ap.parse_args()
    stop_on_sigterm()
    runs: list[dict] = []
    first: list[str] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i, (dtype, threads) in enumerate(a.configs):
            env = server_env(None, "cpu") | server_threads(threads)
            t0 = time.time()
            server = start_bridge_server(
                a.model, "none", work / f"vllm{i}.log", env=env, extra=["--dtype", dtype]
            )
            start_s = time.time() - t0
            try:
                out = work / f"run{i}"
                argv = [sys.executable, "-m", "env_server.evaluate", "--split", a.split]
                argv += ["--limit", str(a.rows), "--inference-url", server.base_url]
                argv += ["--tokenizer", a.model, "--out-dir", str(out)]
                argv += ["--max-prompt-tokens", str(a.max_prompt_tokens)]
                argv += ["--max-tokens", str(a.max_tokens)]
                t0 = time.time()
                with (work / f"run{i}.log").open("w") as log:
                    subprocess.run(
                        argv, check=True, stdout=log, stderr=log, env={**os.environ, **light_env()}
                    )
                wall = time.time() - t0
            finally:
                server.stop()
            metrics = json.loads((out / "metrics.json").read_text())
            texts = completions(out / "predictions.jsonl")
            first = texts if first is None else first
            same = sum(x == y for x, y in zip(texts, first, strict=True))
            runs.append(
                {"dtype": dtype, "threads": threads, "server_start_s": round(start_s, 1)}
                | {"eval_wall_s": round(wall, 1), "same_answers_as_first": same}
                | {k: metrics.get(k) for k in KEYS}
            )
            print(runs[-1], flush=True)
    result = {
        "command": " ".join(["python -m bench.rollout.eval_server", *sys.argv[1:]]),
        "model": Path(a.model).name,
        "split": a.split,
        "rows": a.rows,
        "machine": machine(),
        "runs": runs,
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()

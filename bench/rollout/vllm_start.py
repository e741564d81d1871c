"""How long one patched vLLM CPU server takes to start, its engine core forked from the OpenAI
server (``VLLM_WORKER_MULTIPROC_METHOD=fork``, what ``launch.vllm_server.cpu_env`` sets) or
spawned (vLLM's CPU default); and, ``template``, the whole server forked from a template that
imported vLLM once (``launch.forked``: the test fixtures' servers; the template's own start
is measured apart, once). Alternating, so the box's load drifts hit every method alike.

Per start: seconds from the command to ``/bridge/health`` answering 200, the CPU seconds the
server's processes used by then (user + system, from /proc), and one greedy completion's text
(every method must answer the same). Results: ``docs/results/vllm_start.json``.

    python -m bench.rollout.vllm_start --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine, write_result

METHODS = ("fork", "spawn", "template")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its living descendants."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_start(model: Path, method: str, log_dir: Path) -> dict[str, object]:
    import httpx
    import psutil

    from launch.vllm_server import cpu_env, spawn_bridge_server

    engine = "fork" if method == "template" else method
    env = cpu_env("bench-token") | {"VLLM_WORKER_MULTIPROC_METHOD": engine}
    t0 = time.monotonic()
    log = log_dir / f"{method}.log"
    server = spawn_bridge_server(model, "none", log, env=env, forked=method == "template")
    try:
        server.wait(timeout=900)
        ready = time.monotonic() - t0
        cpu = cpu_seconds(server.proc.pid)
        body = {"model": server.served_model_name, "prompt": "the user clicks", "max_tokens": 8}
        body["temperature"] = 0.0
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        forked = "engine core forked from server pid" in server.proc.log_path.read_text()
        row = dict(ready_s=round(ready, 2), cpu_s=round(cpu, 2), forked=forked)
        if method == "template":  # its CPU so far: its one import and the forks
            t = psutil.Process(server.proc.pid).parent().cpu_times()
            row["template_cpu_s"] = round(t.user + t.system, 2)
        return row | {"text": r.json()["choices"][0]["text"]}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "python -m bench.rollout.vllm_start", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=3, help="starts per method (alternating)")
    p.add_argument("--model", type=Path, default=None, help="default: the embedded tiny model")
    p.add_argument("--out", type=Path, default=RESULTS / "vllm_start.json")
    args = p.parse_args(argv)

    from settings.paths import TINY_MODEL_DIR

    model = args.model or TINY_MODEL_DIR
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        first = one_start(model, "template", Path(tmp))  # the template starts: apart
        print(f"template's first start: {first}", flush=True)
        for i in range(args.rounds):
            for method in METHODS if i % 2 == 0 else reversed(METHODS):
                runs[method].append(row := one_start(model, method, Path(tmp)))
                print(f"round {i + 1}/{args.rounds} {method}: {row}", flush=True)
    texts = {str(r["text"]) for rows in runs.values() for r in rows}
    summary = {
        m: {k: statistics.median(float(r[k]) for r in rows) for k in ("ready_s", "cpu_s")}
        for m, rows in runs.items()
    }
    texts.add(str(first["text"]))
    result = dict(machine=machine(), model=str(model), runs=runs, median=summary)
    result |= dict(template_first_start=first, same_text=len(texts) == 1)
    write_result(args.out, "start", result)
    print(f"median: {summary}; same greedy text: {len(texts) == 1}")
    forked = all(r["forked"] for m in ("fork", "template") for r in runs[m])
    return 0 if len(texts) == 1 and forked else 1


if __name__ == "__main__":
    raise SystemExit(main())

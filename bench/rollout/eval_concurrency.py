"""The evaluations' requests in flight: ``env_server.evaluate`` on one vLLM server at several
``--concurrency`` values, alternating, on the same test rows.

    flock /tmp/heavy.lock .venv/bin/python -m bench.rollout.eval_concurrency --concurrency 4,16,4,16

The server is the default run's: the preset's SFT model (default: the tiny one), vLLM on CPU
with the thread plan ``launch/run_all.sh`` gives it (``launch/threads.py``: one thread pinned
to the last core on 2 cores). Each value runs ``python -m env_server.evaluate`` as the
launcher does (its client start included in the wall time) and records its metrics, so a
change of answers would show. Results: docs/results/eval_concurrency.json (``runs``, in order).
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

from bench.common import RESULTS, machine, parse_list, stop_on_sigterm

KEYS = ("exact_match", "mean_reward", "format_rate", "type_accuracy")


def main() -> None:
    from launch.threads import available_cores, plan_threads
    from launch.vllm_server import server_env, start_bridge_server
    from settings.paths import SFT_MODEL_DIR

    ap = argparse.ArgumentParser(
        "python -m bench.rollout.eval_concurrency",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--concurrency", default="4,16,4,16", help="values, run in this order")
    ap.add_argument("--model", default=str(SFT_MODEL_DIR), help="served model (and tokenizer)")
    ap.add_argument("--rows", type=int, default=512, help="test rows (the launcher's 512)")
    ap.add_argument("--max-prompt-tokens", type=int, default=928)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=RESULTS / "eval_concurrency.json")
    a = ap.parse_args()
    stop_on_sigterm()
    plan = plan_threads(available_cores(), 1, "cpu")
    env = server_env(None, "cpu")
    env.update(plan.for_server(0))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_bridge_server(a.model, "none", work / "vllm.log", env=env)
        try:
            for i, conc in enumerate(parse_list(a.concurrency)):
                out = work / f"run{i}"
                argv = [sys.executable, "-m", "env_server.evaluate", "--split", "test"]
                argv += ["--limit", str(a.rows), "--inference-url", server.base_url]
                argv += ["--tokenizer", a.model, "--concurrency", str(conc), "--out-dir", str(out)]
                argv += ["--max-prompt-tokens", str(a.max_prompt_tokens)]
                argv += ["--max-tokens", str(a.max_tokens)]
                t0 = time.time()
                with (work / f"run{i}.log").open("w") as log:
                    subprocess.run(
                        argv,
                        check=True,
                        stdout=log,
                        stderr=log,
                        env={**os.environ, **plan.light_env},
                    )
                metrics = json.loads((out / "metrics.json").read_text())
                runs.append(
                    {"concurrency": conc, "wall_s": round(time.time() - t0, 1)}
                    | {k: metrics.get(k) for k in KEYS}
                )
                print(runs[-1], flush=True)
        finally:
            server.stop()
    result = {
        "command": " ".join(["bench/rollout/eval_concurrency.py", *sys.argv[1:]]),
        "model": Path(a.model).name,
        "server_threads": plan.for_server(0),
        "machine": machine(),
        "runs": runs,
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()

"""Torn checkpoints: SIGKILL the trainer at random points inside its checkpoint writes, many
times, and check every resume (docs/FAULT_TOLERANCE.md, "A torn checkpoint").

    python -m bench.faults.torn_checkpoint                      # 20 trials in one process, 20 at 2 ranks
    python -m bench.faults.torn_checkpoint --trials 5 --procs 1 # a quicker look
    python -m bench.faults.torn_checkpoint --out docs/results/torn_checkpoint

For each trainer size (``--procs``: 1 = one process, 2 = torchrun with 2 ranks and sharded
DCP checkpoints) it runs ``python -m trainer grpo`` on the embedded tiny model against a real
API and a real patched vLLM server (bridge mode ``none``), on fabricated groups served in the
same order to every run (bench/faults/lineage.py):

1. an uninterrupted reference run of ``2 x trials + 2`` steps (every checkpoint kept);
2. the same run, SIGKILLed ``trials`` times, each time at a random moment within the median
   checkpoint write of the reference (its ``checkpoint_s``: write + ack) after the write of
   the first or second step after the last resume began (the whole process group, or under torchrun one random rank or the
   group), then resumed with ``--resume``.

After every kill: each published ``step_*`` is complete, and the newest holds the reference's
weights at its step (bitwise at the same world size); the resumed run starts from it. At the
end: the weights equal the reference's, every batch the API acked was trained once (the
checkpoint lineage, the API's database), each step at the same batch as the reference.
Writes ``<out>/torn_checkpoint.json`` (every trial: step, delay, what was killed, where the
kill landed, what was left on disk) and prints a summary. Needs no GPU; ~1 minute per trial
in one process on a loaded 2-core box, ~1.5 at 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from bench.common import machine


def one_size(
    procs: int, trials: int, seed: int, root: Path, vllm_url: str, model: Path, forked: bool
) -> dict:
    from bench.faults.lineage import Lineage, fabricate_groups, reference, torn_run

    steps = 2 * trials + 2
    groups = fabricate_groups(model, steps + 4)
    kw = {"procs": procs, "forked": forked}
    ref = Lineage(root, f"reference{procs}", model, vllm_url, groups, steps, keep=steps, **kw)
    lin = None
    try:
        t0 = time.monotonic()
        window = reference(ref)
        ref_s = time.monotonic() - t0
        lin = Lineage(root, f"torn{procs}", model, vllm_url, groups, steps, **kw)
        t0 = time.monotonic()
        out = torn_run(lin, ref, random.Random(seed + procs), trials, window, 0.0)
        out.update(procs=procs, steps=steps, window_s=round(window, 3))
        out.update(reference_s=round(ref_s, 1), torn_run_s=round(time.monotonic() - t0, 1))
        return out
    finally:
        ref.stop()
        if lin is not None:
            lin.stop()


def summary(result: dict) -> str:
    trials = result["trials"]
    phases = Counter(t["phase"].split(" (")[0] for t in trials)
    killed = Counter(t["killed"] for t in trials)
    return (
        f"procs={result['procs']}: {len(trials)} kills inside checkpoint writes, {result['steps']} "
        f"steps; landed: {dict(phases)}; killed: {dict(killed)}; every resume from the last "
        f"complete checkpoint: {all(t['resumed_at'] == t['last_complete'] for t in trials)}; "
        f"final weights vs uninterrupted: max |diff| {result['final_max_weight_diff']}; groups "
        f"trained {result['groups_trained']}, twice {result['groups_trained_twice']}; batches "
        f"leased {result['batches_leased']}, acked {result['batches_acked']}, expired "
        f"{result['batches_expired']}; {result['torn_run_s']} s (+ reference {result['reference_s']} s)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        "python -m bench.faults.torn_checkpoint",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--trials", type=int, default=20, help="kills per trainer size (default 20)")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="trainer sizes (1 2)")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--out", type=Path, default=None, help="folder for torn_checkpoint.json")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument(
        "--forked-starts",
        action="store_true",
        help="start the one-process trainers as forks of a process that imported vLLM, torch "
        "and transformers once (launch/forked.py): ~5 s less CPU per start",
    )
    a = ap.parse_args()
    import tempfile

    from launch.vllm_server import start_bridge_server
    from settings.paths import TINY_MODEL_DIR
    from trainer.tiny_model import build_tiny_model, is_built

    if not is_built(TINY_MODEL_DIR):
        build_tiny_model(TINY_MODEL_DIR)
    work = a.work or Path(tempfile.mkdtemp(prefix="torn_checkpoint-"))
    from bench.faults.lineage import TOKEN

    t0 = time.monotonic()
    before = machine()
    server = start_bridge_server(TINY_MODEL_DIR, "none", work / "vllm.log", token=TOKEN)
    results = []
    try:
        for procs in a.procs:
            results.append(
                one_size(
                    procs, a.trials, a.seed, work, server.base_url, TINY_MODEL_DIR, a.forked_starts
                )
            )
            print(summary(results[-1]), flush=True)
    finally:
        server.stop()
    report = {
        "machine": before,
        "loadavg_after": machine()["loadavg"],
        "total_s": round(time.monotonic() - t0, 1),
        "results": results,
    }
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "torn_checkpoint.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

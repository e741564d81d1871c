"""``python -m tests.unit.bench_child --child SPEC --child-result FILE``: a measured point's
child as ``bench.common.run_child`` starts one (test_bench_helpers.py): it writes the spec
back with its own PID and ``BENCH_CHILD_ENV``, or exits 3 without a result when the spec
asks it to fail."""

import argparse
import json
import os
from pathlib import Path

from bench.common import write_child_result

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", required=True)
    ap.add_argument("--child-result", type=Path, required=True)
    a = ap.parse_args()
    spec = json.loads(a.child)
    print("RESULT {} (stdout is not where the result is read from)", flush=True)
    if spec.get("fail"):
        raise SystemExit(3)
    write_child_result(
        a.child_result, {**spec, "pid": os.getpid(), "env": os.environ.get("BENCH_CHILD_ENV")}
    )

"""The trainer ranks of one more node of a multi-node run (``NNODES`` > 1).

Node 0 runs ``launch/run_all.sh --trainer-procs N`` with ``NNODES``/``NODE_RANK=0``/
``MASTER_ADDR``/``MASTER_PORT`` set: it starts the services and its own N trainer ranks under
torchrun, and writes the trainer's command to ``<run-dir>/trainer_argv.json``. Every other
node runs, with the same variables and its own ``NODE_RANK``::

    python -m launch.trainer_node --run-dir RUN_DIR     # RUN_DIR on a shared filesystem

which waits for that file and runs the same command with its ``--node-rank``, in the
foreground (its exit code is the trainer's). See docs/MULTINODE.md and
launch/slurm_example.sbatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

ARGV_FILE = "trainer_argv.json"


def launcher_argv(python: str, procs: int, env: Mapping[str, str]) -> list[str]:
    """How to start the trainer: ``python`` alone for one process on one node; torchrun with
    ``procs`` ranks per node otherwise (``--standalone`` on one node; with ``NNODES`` > 1 the
    static rendezvous of ``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``, as Atropos users set
    them)."""
    nnodes = int(env.get("NNODES") or 1)
    if procs == 1 and nnodes == 1:
        return [python]
    run = [python, "-m", "torch.distributed.run", f"--nproc-per-node={procs}"]
    if nnodes == 1:
        return [*run, "--standalone"]
    missing = [v for v in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if missing:
        raise ValueError(f"NNODES={nnodes} needs {', '.join(missing)} set too")
    return [
        *run,
        f"--nnodes={nnodes}",
        f"--node-rank={env['NODE_RANK']}",
        f"--master-addr={env['MASTER_ADDR']}",
        f"--master-port={env['MASTER_PORT']}",
    ]


def publish_trainer_argv(run_dir: Path, argv: list[str]) -> Path:
    """Node 0: write the trainer's command (it holds the bridge token: owner-only file)."""
    path = Path(run_dir) / ARGV_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"argv": argv}, f)
    os.replace(tmp, path)
    return path


def for_node(argv: list[str], node_rank: int) -> list[str]:
    """Node 0's command with this node's ``--node-rank``."""
    out = [f"--node-rank={node_rank}" if a.startswith("--node-rank=") else a for a in argv]
    if out == argv and f"--node-rank={node_rank}" not in argv:
        raise ValueError("the published trainer command is not a multi-node torchrun command")
    return out


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m launch.trainer_node",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--run-dir", required=True, type=Path, help="node 0's --run-dir (shared)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds to wait for node 0 to publish the command",
    )
    ns = ap.parse_args(args)
    if not os.environ.get("NODE_RANK"):
        ap.error("NODE_RANK is not set (this node's index, 1..NNODES-1)")
    path = ns.run_dir / ARGV_FILE
    deadline = time.monotonic() + ns.timeout
    while not path.exists():
        if time.monotonic() > deadline:
            print(f"error: {path} did not appear in {ns.timeout:.0f}s", file=sys.stderr)
            return 1
        time.sleep(2.0)
    argv = for_node(json.loads(path.read_text())["argv"], int(os.environ["NODE_RANK"]))
    return subprocess.call(argv)


if __name__ == "__main__":
    sys.exit(main())

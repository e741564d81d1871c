"""Dataset tools.

    python -m env_server.data build   [--out DIR] [--num-sessions 3000] [--seed 0]
    python -m env_server.data convert --input FILE [--format auto|rows|shop_r1|opera] [--out DIR]
    python -m env_server.data stats   [--out DIR]

``convert`` reads user data (Shop-R1 JSONL or OPeRA-style rows), validates every row, splits it
by session and writes the same layout ``build`` writes, so training and evaluation use it as is.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def stats(data_dir: Path) -> dict:
    from env_server.data.dataset import load_dataset_dir
    from env_server.eval_stats import oracle_exact_match

    out = {}
    for name, ds in load_dataset_dir(data_dir).items():
        types = Counter(ds["action_type"])
        out[name] = {
            "rows": len(ds),
            "sessions": len(set(ds["session_id"])),
            "action_types": {t: round(n / len(ds), 3) for t, n in sorted(types.items())},
            "best_reachable_exact_match": oracle_exact_match(ds["alternatives"]),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    from settings.paths import DATA_DIR, DATA_SEED, NUM_SESSIONS

    ap = argparse.ArgumentParser(
        "python -m env_server.data",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("command", choices=["build", "convert", "stats"])
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="dataset folder")
    ap.add_argument(
        "--num-sessions", type=int, default=NUM_SESSIONS, help="build: sessions to simulate"
    )
    ap.add_argument("--seed", type=int, default=DATA_SEED, help="simulation and split seed")
    ap.add_argument("--input", type=Path, help="convert: the user data file")
    ap.add_argument("--format", default="auto", help="convert: auto, rows, shop_r1 or opera")
    args = ap.parse_args(argv)

    from env_server.data.dataset import (
        build_and_save,
        save_dataset,
        split_by_session,
        write_manifest,
    )
    from env_server.data.loaders import load_user_data

    if args.command == "build":
        build_and_save(args.num_sessions, args.seed, args.out)
    elif args.command == "convert":
        if args.input is None:
            ap.error("convert needs --input")
        save_dataset(split_by_session(load_user_data(args.input, args.format), args.seed), args.out)
        write_manifest(args.out, source="converted", input=str(args.input), seed=args.seed)
    print(json.dumps(stats(args.out), indent=2))


if __name__ == "__main__":
    main()

"""The Shop-R1 dataset: one row per step, split into train/validation/test by session.

Row schema (docs/INTERFACES.md):
    session_id: str, step: int,
    pages: list[str]             simplified HTML of every page so far, oldest first
    previous_actions: list[str]  JSON of the action taken on each earlier page (len(pages) - 1)
    rationale: str, action: str  the gold rationale and action JSON (keys its type needs)
    action_type: str             the gold action's type (for stratified metrics)
    alternatives: str            JSON [[action_json, prob], ...] of the simulated shopper's
                                 plausible actions ("[]" for real data)
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets

from env_server.actions import action_to_json
from env_server.data.loaders import load_rows
from env_server.data.schema import FEATURES, SPLITS
from env_server.data.shopper import Session
from env_server.data.simulator import generate_sessions
from settings.paths import DATA_SEED, NUM_SESSIONS


def rows_from_session(session: Session) -> list[dict[str, Any]]:
    """The dataset rows of one simulated session (step i sees pages 0..i)."""
    pages = [s.page for s in session.steps]
    actions = [action_to_json(s.action) for s in session.steps]
    return [
        {
            "session_id": session.session_id,
            "step": i,
            "pages": pages[: i + 1],
            "previous_actions": actions[:i],
            "rationale": s.rationale,
            "action": actions[i],
            "action_type": s.action["type"],
            "alternatives": json.dumps(s.alternatives),
        }
        for i, s in enumerate(session.steps)
    ]


def split_of(index: int, order: list[int], val_fraction: float, test_fraction: float) -> str:
    """Which split the session at ``index`` falls in, given a seeded permutation ``order``."""
    n = len(order)
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    rank = order[index]
    if rank < n_test:
        return "test"
    if rank < n_test + n_val:
        return "validation"
    return "train"


def build_dataset(
    num_sessions: int = NUM_SESSIONS,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
) -> datasets.DatasetDict:
    """Simulate ``num_sessions`` sessions and split them (by session) into three splits."""
    sessions = generate_sessions(num_sessions, seed)
    order = list(range(num_sessions))
    random.Random(f"shop-r1-split-{seed}").shuffle(order)
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for i, session in enumerate(sessions):
        rows[split_of(i, order, val_fraction, test_fraction)].extend(rows_from_session(session))
    return datasets.DatasetDict(
        {s: datasets.Dataset.from_list(rows[s], features=FEATURES) for s in SPLITS}
    )


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> int:
    """Write rows atomically (temp file + rename): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def save_dataset(dsd: datasets.DatasetDict, out_dir: Path | str) -> dict[str, int]:
    """Write ``<split>.jsonl`` for every split; returns rows written per split."""
    out = Path(out_dir)
    return {name: write_jsonl(iter(ds), out / f"{name}.jsonl") for name, ds in dsd.items()}


def load_dataset_dir(data_dir: Path | str) -> datasets.DatasetDict:
    """Read the ``<split>.jsonl`` files of a folder, validating every row (clear errors)."""
    d = Path(data_dir)
    found = {s: d / f"{s}.jsonl" for s in SPLITS if (d / f"{s}.jsonl").exists()}
    if not found:
        raise FileNotFoundError(f"no train/validation/test .jsonl files in {d}")
    return datasets.DatasetDict({s: load_rows(p) for s, p in found.items()})


MANIFEST = "manifest.json"
"""What a dataset folder holds: ``{"source": "simulated", "num_sessions": N, "seed": S}`` (or
``"converted"`` user data), written beside the splits and checked by :func:`load_or_build`."""


class DatasetMismatch(ValueError):
    """The dataset on disk is not the one asked for; the message names both and the fix."""


def write_manifest(out_dir: Path | str, **identity: Any) -> None:
    """Record what ``out_dir`` holds (``source``, ``num_sessions``, ``seed``, ...)."""
    path = Path(out_dir) / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity, indent=2) + "\n")


def build_and_save(num_sessions: int, seed: int, out_dir: Path | str) -> dict[str, int]:
    """Simulate, save the splits and their manifest; returns rows written per split."""
    written = save_dataset(build_dataset(num_sessions, seed), out_dir)
    write_manifest(out_dir, source="simulated", num_sessions=num_sessions, seed=seed)
    return written


def check_identity(
    d: Path, dsd: datasets.DatasetDict, num_sessions: int, seed: int | None = None
) -> None:
    """A simulated dataset must be the one asked for (its manifest; an older folder without
    one: its number of sessions; its seed only when one is asked for); converted user data is
    taken as it is."""
    manifest = d / MANIFEST
    have = json.loads(manifest.read_text()) if manifest.exists() else None
    if have is not None and have.get("source") != "simulated":
        return
    if have is None:
        have = {"num_sessions": len({s for ds in dsd.values() for s in ds["session_id"]})}
    same_seed = seed is None or have.get("seed", seed) == seed
    if have.get("num_sessions") == num_sessions and same_seed:
        return
    held = f"{have.get('num_sessions')} sessions" + (
        f" (seed {have['seed']})" if "seed" in have else ""
    )
    raise DatasetMismatch(
        f"{d} holds a dataset of {held}, but {num_sessions} sessions"
        f"{'' if seed is None else f' (seed {seed})'} were asked "
        f"for. Use it as it is (drop --num-sessions / data.num_sessions, or set it to "
        f"{have.get('num_sessions')}), or build the other one elsewhere (--data-dir NEW_DIR); "
        f"nothing was overwritten."
    )


def load_or_build(
    data_dir: Path | str, num_sessions: int | None = None, seed: int | None = None
) -> datasets.DatasetDict:
    """Load the dataset in ``data_dir``; simulate and save it there first if it is missing
    (``num_sessions`` sessions, default ``settings.paths.NUM_SESSIONS``; ``seed``, default
    ``settings.paths.DATA_SEED``). With ``num_sessions`` given, a dataset of another size
    there is a :class:`DatasetMismatch`, and of another seed when ``seed`` is given too (never
    a silent swap, never overwritten). The services ask by size only: a run's ``--seed``
    (training and sampling) does not choose the dataset, whose held-out rows stay the same."""
    d = Path(data_dir)
    if not any((d / f"{s}.jsonl").exists() for s in SPLITS):
        n = NUM_SESSIONS if num_sessions is None else num_sessions
        build_and_save(n, DATA_SEED if seed is None else seed, d)
        return load_dataset_dir(d)
    dsd = load_dataset_dir(d)
    if num_sessions is not None:
        check_identity(d, dsd, num_sessions, seed)
    return dsd


def split_by_session(
    ds: datasets.Dataset, seed: int = 0, val_fraction: float = 0.1, test_fraction: float = 0.1
) -> datasets.DatasetDict:
    """Split rows of user data into train/validation/test, keeping each session in one split."""
    sessions = sorted(set(ds["session_id"]))
    order = list(range(len(sessions)))
    random.Random(f"shop-r1-split-{seed}").shuffle(order)
    where = {s: split_of(i, order, val_fraction, test_fraction) for i, s in enumerate(sessions)}
    names = ds["session_id"]
    return datasets.DatasetDict(
        {s: ds.select([i for i, n in enumerate(names) if where[n] == s]) for s in SPLITS}
    )

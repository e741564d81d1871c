"""Loaders for user data, turned into the dataset's row schema (``schema.py``).

Three input formats, read from ``.jsonl`` / ``.json`` (line by line, so errors name the line)
or ``.csv`` / ``.parquet`` (through ``datasets``; errors name the row):

- ``rows``: this project's own rows (what ``save_dataset`` writes).
- ``shop_r1``: one row per step, Shop-R1 style: ``context`` (the current page's HTML, or a list
  of every page so far), ``previous_actions`` (list of action objects or JSON strings, optional),
  ``rationale`` and ``action`` (``{"type", "name", "text"}`` object or JSON string);
  ``session_id`` / ``step`` optional.
- ``opera``: one row per action, OPeRA style: ``session_id``, ``action_type``,
  ``simplified_html``, ``rationale``, ``input_text`` and the element name in one of ``name`` /
  ``target_name`` / ``element_name`` / ``target``; rows of a session in order (or a ``step`` /
  ``timestamp`` field to sort by). Each action becomes one step whose context is the session so far.

A malformed row raises :class:`DataFormatError` naming the file, the line (or row) and the field,
before any training starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets

from env_server.actions import ACTION_TYPES, REQUIRED_KEYS, action_to_json
from env_server.data.schema import FEATURES

MISSING_PAGE = "(page HTML not recorded)"
"""Stands in for earlier pages a Shop-R1 row gives only actions for."""

TYPE_ALIASES = {
    "click": "click",
    "type_and_submit": "type_and_submit",
    "input": "type_and_submit",
    "type": "type_and_submit",
    "search": "type_and_submit",
    "terminate": "terminate",
    "close": "terminate",
    "end": "terminate",
}
NAME_FIELDS = ("name", "target_name", "element_name", "target")


class DataFormatError(ValueError):
    """A row of user data that cannot be used; the message says where and why."""

    def __init__(self, path: Path | str, where: str, field: str, problem: str) -> None:
        super().__init__(f"{path}:{where}: field '{field}': {problem}")
        self.path, self.where, self.field, self.problem = str(path), where, field, problem


def iter_records(path: Path | str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(location, record)``; location is ``line N`` (JSONL) or ``row N`` (others)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(p)
    if p.suffix in (".jsonl", ".json"):
        with p.open("rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataFormatError(p, f"line {n}", "<row>", f"not UTF-8 ({e})") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFormatError(p, f"line {n}", "<row>", f"invalid JSON ({e})") from None
                if not isinstance(rec, dict):
                    raise DataFormatError(p, f"line {n}", "<row>", "expected a JSON object")
                yield f"line {n}", rec
        return
    kind = {".csv": "csv", ".parquet": "parquet"}.get(p.suffix)
    if kind is None:
        raise ValueError(f"{p}: unsupported file type {p.suffix!r} (jsonl, json, csv, parquet)")
    ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    for n, rec in enumerate(ds, start=1):
        yield f"row {n}", dict(rec)


def _str(rec: dict[str, Any], key: str, ctx: tuple[Path, str], allow_empty: bool = False) -> str:
    if key not in rec or rec[key] is None:
        raise DataFormatError(*ctx, key, "missing")
    v = rec[key]
    if not isinstance(v, str):
        raise DataFormatError(*ctx, key, f"expected a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise DataFormatError(*ctx, key, "empty")
    return v


def _step(rec: dict[str, Any], ctx: tuple[Path, str], default: int) -> int:
    """The optional ``step`` field as a whole number (``3``, ``3.0`` or ``"3"``)."""
    v = rec.get("step")
    if v is None:
        return default
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        return int(v)
    except (TypeError, ValueError):
        raise DataFormatError(*ctx, "step", f"expected a whole number, got {v!r}") from None


def _alternatives(rec: dict[str, Any], ctx: tuple[Path, str]) -> str:
    """The optional ``alternatives`` field: a JSON string holding a list."""
    v = rec.get("alternatives") or "[]"
    try:
        if not isinstance(v, str) or not isinstance(json.loads(v), list):
            raise ValueError
    except ValueError:
        raise DataFormatError(
            *ctx, "alternatives", f"expected a JSON string holding a list, got {v!r:.80}"
        ) from None
    return v


def _rationale(rec: dict[str, Any], ctx: tuple[Path, str], allow_missing: bool) -> str:
    """The row's rationale; with ``allow_missing`` a missing/empty one is ``""`` (rows that
    ``env_server.synthesize`` fills in), otherwise it must be a non-empty string."""
    if allow_missing and (rec.get("rationale") is None or rec.get("rationale") == ""):
        return ""
    return _str(rec, "rationale", ctx)


def parse_action(value: Any, ctx: tuple[Path, str], field: str = "action") -> str:
    """Validate an action (object or JSON string) and return its canonical JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataFormatError(*ctx, field, f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise DataFormatError(*ctx, field, "expected an object with a 'type'")
    kind = TYPE_ALIASES.get(str(value.get("type", "")).lower())
    if kind is None:
        raise DataFormatError(
            *ctx, f"{field}.type", f"{value.get('type')!r} is not one of {ACTION_TYPES}"
        )
    for key in REQUIRED_KEYS[kind]:
        if not isinstance(value.get(key), str) or not value[key].strip():
            raise DataFormatError(
                *ctx, f"{field}.{key}", f"a {kind} action needs a non-empty {key}"
            )
    return action_to_json({**value, "type": kind})


def _to_dataset(rows: list[dict[str, Any]], path: Path) -> datasets.Dataset:
    if not rows:
        raise DataFormatError(path, "line 0", "<file>", "no rows")
    return datasets.Dataset.from_list(rows, features=FEATURES)


def load_rows(path: Path | str, allow_missing_rationale: bool = False) -> datasets.Dataset:
    """This project's own row format, validated."""
    p = Path(path)
    rows = []
    for where, rec in iter_records(p):
        ctx = (p, where)
        pages, prev = rec.get("pages"), rec.get("previous_actions")
        if not isinstance(pages, list) or not pages or not all(isinstance(x, str) for x in pages):
            raise DataFormatError(*ctx, "pages", "expected a non-empty list of HTML strings")
        if not isinstance(prev, list) or len(prev) != len(pages) - 1:
            raise DataFormatError(*ctx, "previous_actions", "expected len(pages) - 1 actions")
        action = parse_action(rec.get("action"), ctx)
        rows.append(
            {
                "session_id": _str(rec, "session_id", ctx),
                "step": _step(rec, ctx, len(pages) - 1),
                "pages": pages,
                "previous_actions": [
                    parse_action(a, ctx, f"previous_actions[{i}]") for i, a in enumerate(prev)
                ],
                "rationale": _rationale(rec, ctx, allow_missing_rationale),
                "action": action,
                "action_type": json.loads(action)["type"],
                "alternatives": _alternatives(rec, ctx),
            }
        )
    return _to_dataset(rows, p)


def load_shop_r1(path: Path | str, allow_missing_rationale: bool = False) -> datasets.Dataset:
    """Shop-R1-style step rows (see the module docstring)."""
    p = Path(path)
    rows = []
    for n, (where, rec) in enumerate(iter_records(p)):
        ctx = (p, where)
        ctx_val = rec.get("context")
        if isinstance(ctx_val, str) and ctx_val.strip():
            pages_given = [ctx_val]
        elif isinstance(ctx_val, list) and ctx_val and all(isinstance(x, str) for x in ctx_val):
            pages_given = ctx_val
        else:
            raise DataFormatError(*ctx, "context", "expected page HTML or a list of pages")
        prev_raw = rec.get("previous_actions") or []
        if not isinstance(prev_raw, list):
            raise DataFormatError(*ctx, "previous_actions", "expected a list of actions")
        prev = [parse_action(a, ctx, f"previous_actions[{i}]") for i, a in enumerate(prev_raw)]
        if len(pages_given) > len(prev) + 1:
            raise DataFormatError(*ctx, "context", "more pages than previous_actions + 1")
        # Earlier pages the row does not carry keep their place, so actions stay aligned.
        pages = [MISSING_PAGE] * (len(prev) + 1 - len(pages_given)) + pages_given
        action = parse_action(rec.get("action"), ctx)
        rows.append(
            {
                "session_id": str(rec.get("session_id", f"{p.stem}-{n}")),
                "step": _step(rec, ctx, len(prev)),
                "pages": pages,
                "previous_actions": prev,
                "rationale": _rationale(rec, ctx, allow_missing_rationale),
                "action": action,
                "action_type": json.loads(action)["type"],
                "alternatives": "[]",
            }
        )
    return _to_dataset(rows, p)


def _opera_action(rec: dict[str, Any], ctx: tuple[Path, str]) -> str:
    name = next((rec[k] for k in NAME_FIELDS if isinstance(rec.get(k), str) and rec[k]), "")
    return parse_action(
        {"type": rec.get("action_type"), "name": name, "text": rec.get("input_text") or ""},
        ctx,
        field="action_type",
    )


def load_opera(path: Path | str, allow_missing_rationale: bool = False) -> datasets.Dataset:
    """OPeRA-style action rows, grouped into sessions (see the module docstring)."""
    p = Path(path)
    sessions: dict[str, list[tuple[Any, int, str, str, str]]] = {}
    for n, (where, rec) in enumerate(iter_records(p)):
        ctx = (p, where)
        if isinstance(rec.get("session_id"), int):  # numeric ids are common in CSV exports
            rec["session_id"] = str(rec["session_id"])
        sid = _str(rec, "session_id", ctx)
        html = _str(rec, "simplified_html", ctx)
        action = _opera_action(rec, ctx)
        order = rec.get("step", rec.get("timestamp", n))
        rationale = _rationale(rec, ctx, allow_missing_rationale)
        sessions.setdefault(sid, []).append((order, n, html, action, rationale))
    rows = []
    for sid, steps in sessions.items():
        try:
            steps.sort(key=lambda s: (s[0], s[1]))
        except TypeError:
            raise DataFormatError(p, f"session {sid}", "step", "mixed types, cannot sort") from None
        pages = [s[2] for s in steps]
        actions = [s[3] for s in steps]
        for i, (_, _, _, action, rationale) in enumerate(steps):
            rows.append(
                {
                    "session_id": sid,
                    "step": i,
                    "pages": pages[: i + 1],
                    "previous_actions": actions[:i],
                    "rationale": rationale,
                    "action": action,
                    "action_type": json.loads(action)["type"],
                    "alternatives": "[]",
                }
            )
    return _to_dataset(rows, p)


LOADERS = {"rows": load_rows, "shop_r1": load_shop_r1, "opera": load_opera}


def detect_format(path: Path | str) -> str:
    """Guess the format from the first record's fields."""
    for _, rec in iter_records(path):
        if "pages" in rec:
            return "rows"
        if "simplified_html" in rec and "action_type" in rec:
            return "opera"
        if "context" in rec:
            return "shop_r1"
        raise DataFormatError(
            path,
            "line 1",
            "<row>",
            "unknown format: expected 'pages', 'context' or 'simplified_html'",
        )
    raise DataFormatError(path, "line 0", "<file>", "no rows")


def load_user_data(
    path: Path | str, fmt: str = "auto", allow_missing_rationale: bool = False
) -> datasets.Dataset:
    """Load one file of user data in ``fmt`` (``auto``, ``rows``, ``shop_r1``, ``opera``).

    ``allow_missing_rationale``: accept rows whose rationale is missing or empty (they get
    ``""``); for inputs of ``env_server.synthesize``, never for training data."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in LOADERS:
        raise ValueError(f"unknown format {fmt!r}; expected auto or one of {sorted(LOADERS)}")
    return LOADERS[fmt](path, allow_missing_rationale=allow_missing_rationale)

"""The dataset's row schema (docs/INTERFACES.md): its splits and its ``datasets`` features,
shared by the simulated dataset (dataset.py) and the loaders of user data (loaders.py)."""

from __future__ import annotations

import datasets

SPLITS = ("train", "validation", "test")
FEATURES = datasets.Features(
    {
        "session_id": datasets.Value("string"),
        "step": datasets.Value("int64"),
        "pages": datasets.Sequence(datasets.Value("string")),
        "previous_actions": datasets.Sequence(datasets.Value("string")),
        "rationale": datasets.Value("string"),
        "action": datasets.Value("string"),
        "action_type": datasets.Value("string"),
        "alternatives": datasets.Value("string"),
    }
)

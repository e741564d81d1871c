"""bench.trainer.precision runs the trainer's real GRPO step once per ``--precision`` (it had
gone stale once: a changed ``start_run`` hook signature broke it with nothing to notice)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.trainer.precision import measure
from trainer.precision import choose_precision

pytestmark = pytest.mark.unit


def test_each_precision_takes_real_steps_in_the_dtype_it_resolves_to(
    tiny_model_dir: Path,
) -> None:
    import torch

    args = argparse.Namespace(
        model="tiny", batch_size=4, group_size=2, seq_len=32, steps=2, precisions="fp32,auto"
    )
    rows = {r["precision"]: r for r in measure(args)}
    assert rows.keys() == {"fp32", "auto"}
    auto_dtype, _ = choose_precision("auto", torch.device("cpu"))
    assert rows["fp32"]["compute_dtype"] == "float32"
    assert rows["auto"]["compute_dtype"] == str(auto_dtype).removeprefix("torch.")
    for r in rows.values():
        assert len(r["wall_s"]) == len(r["cpu_s"]) == 2
        assert all(t > 0 for t in r["wall_s"] + r["cpu_s"])
        assert r["cpu_median_s"] == sorted(r["cpu_s"][1:])[0]  # the warm-up round left out

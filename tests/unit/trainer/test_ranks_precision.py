"""Under torchrun every rank computes in rank 0's precision (trainer/run.py ``ranks_precision``):
two real gloo ranks whose own bf16 timings disagree end up with one dtype. A rank in bf16 beside
one in fp32 all-gathered FSDP shards of two sizes and gloo aborted the run (seen once in the
suite: ``test_launch_fsdp``, "Received data size doesn't match expected size. 677632 vs
338816": 338,816 is the tiny model's root shard per rank, and 2:1 the ratio of an fp32 message
to a bf16 one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import SftConfig
from trainer.distributed import Dist
from trainer.precision import CpuBf16Source
from trainer.run import ranks_precision

pytestmark = pytest.mark.unit


CASES = [(["fp32", "bf16"], "auto"), (["bf16", "fp32"], "auto"), (["bf16", "fp32"], "fp32")]
"""(which precision each rank's own timing favours, ``--precision``)."""


def _rank(rank: int, store: str, out: str) -> None:
    """One rank: each case's ``ranks_precision``, this rank's timing saying bf16 is faster
    (``faster[rank] == "bf16"``) or slower."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        d = Dist(rank, 2, rank, None, dist.group.WORLD, torch.device("cpu"))
        got = []
        for faster, precision in CASES:
            times = (2e-4, 1e-4) if faster[rank] == "bf16" else (1e-4, 2e-4)  # (fp32, bf16)
            source = CpuBf16Source(
                flags=lambda: {"avx512_bf16": True, "cpu_name": "test CPU"},
                dispatch=lambda: "AVX512",
                measure=lambda times=times: times,
            )
            got.append(ranks_precision(SftConfig(precision=precision), d, source))
        Path(f"{out}.{rank}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_zeros_precision(tmp_path: Path) -> None:
    out = str(tmp_path / "got")
    mp.start_processes(_rank, (str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    # per case, both ranks: rank 1 alone timed bf16 faster; rank 0 alone; fp32 as asked
    assert got == [["fp32", "bf16", "fp32"], ["fp32", "bf16", "fp32"]]

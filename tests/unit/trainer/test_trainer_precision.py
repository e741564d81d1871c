"""``--precision auto`` (trainer/precision.py): bf16 only where the CPU runs it natively.

Every branch runs on any machine: the capability source is passed in. The real source is
checked too, and so is the case issue 21 found (bf16 emulated, 30-80x slower than fp32),
reproduced on any x86 CPU with ``ONEDNN_MAX_CPU_ISA=AVX2``."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.run_config import parse_args
from trainer.precision import (
    NATIVE_BF16_FLAGS,
    CpuBf16Source,
    choose_precision,
    cpu_bf16,
    measure_matmul,
)

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def _never() -> tuple[float, float]:
    raise AssertionError("measured although the CPU has no native bf16")


def _source(flags: dict, timings: tuple[float, float] | None = None) -> CpuBf16Source:
    return CpuBf16Source(
        flags=lambda: {"cpu_name": "Test CPU", **flags},
        dispatch=lambda: "AVX2",
        measure=(lambda: timings) if timings else _never,
    )


def test_auto_without_native_bf16_is_fp32_and_measures_nothing() -> None:
    """An AVX2-only CPU (issue 21's AMD EPYC): fp32 at once, so auto costs what fp32 costs."""
    dtype, why = choose_precision("auto", CPU, _source({"avx2": True, "avx512_f": True}))
    assert dtype == torch.float32
    assert "no native bf16" in why and "Test CPU" in why and "AVX2" in why


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16", "sve_bf16"])
def test_auto_with_native_bf16_that_measures_faster_is_bf16(flag: str) -> None:
    dtype, why = choose_precision("auto", CPU, _source({flag: True}, (3e-4, 8e-5)))
    assert dtype == torch.bfloat16 and flag in why and "bf16 0.080 ms" in why


def test_auto_with_the_flags_but_slow_bf16_is_fp32() -> None:
    """The flags describe the chip; oneDNN limited to AVX2 still emulates bf16."""
    dtype, why = choose_precision("auto", CPU, _source({"avx512_bf16": True}, (3e-4, 2.5e-2)))
    assert dtype == torch.float32 and "not faster" in why


@pytest.mark.parametrize(
    ("flags", "timings", "kind"),
    [
        ({"avx2": True}, None, "none"),
        ({"avx512_bf16": True}, (2.1e-4, 4.1e-4), "slower"),  # the Intel Xeon of 2026-12-01
        ({"avx512_bf16": True}, (3e-4, 2.5e-2), "slower"),  # emulated: oneDNN held to AVX2
        ({"amx_bf16": True}, (3e-4, 8e-5), "native"),
    ],
)
def test_what_bf16_is_on_the_cpu(flags: dict, timings: tuple | None, kind: str) -> None:
    """The kind the cost probe names (``bf16 slower than fp32 here`` where the CPU reports
    bf16 but its matmul measures no faster)."""
    assert cpu_bf16(_source(flags, timings))[0] == kind


def test_explicit_precisions_are_taken_as_asked() -> None:
    slow = _source({})
    assert choose_precision("bf16", CPU, slow)[0] == torch.bfloat16
    assert choose_precision("fp32", CPU, slow)[0] == torch.float32
    with pytest.raises(ValueError, match="auto, bf16 or fp32"):
        choose_precision("fp16", CPU, slow)


def test_the_real_source_agrees_with_the_cpu_flags() -> None:
    flags = torch.cpu.get_capabilities()
    dtype, why = choose_precision("auto", CPU)
    if not any(flags.get(f) for f in NATIVE_BF16_FLAGS):
        assert dtype == torch.float32, why
    assert why.startswith("auto: ")
    threads = torch.get_num_threads()
    fp32_s, bf16_s = measure_matmul(size=64, repeats=2)
    assert fp32_s > 0 and bf16_s > 0 and torch.get_num_threads() == threads


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN x86 ISA knob")
def test_emulated_bf16_resolves_to_fp32_on_any_x86_cpu(tmp_path: Path) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes bf16 matmuls emulated, as on issue 21's AVX2-only CPU:
    auto must pick fp32 whether this CPU has the bf16 flags (caught by the measurement) or
    not (caught by the flags). Asked as the launcher asks it for ``--eval-dtype auto``
    (``python -m trainer.precision`` in a child), so the launcher itself never imports torch
    and keeps the run's dtype for the evaluations."""
    code = (
        "import sys; from pathlib import Path; from launch.configs import resolve_for_run; "
        "from launch.run_plan import eval_dtype; "
        "cfg = resolve_for_run(['--eval-server', 'own'], 'http://127.0.0.1:1', "
        f"['http://127.0.0.1:2'], Path({str(tmp_path)!r})); "
        "print(eval_dtype(cfg, 'cpu'), 'torch' in sys.modules)"
    )
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).parent.resolve().parents[2]),
    }
    run = {"env": env, "capture_output": True, "text": True, "timeout": 300, "check": True}
    out = subprocess.run([sys.executable, "-c", code], **run).stdout
    assert out.split() == ["None", "False"], out
    argv = [sys.executable, "-m", "trainer.precision", "--precision", "auto"]
    dtype, why = subprocess.run(argv, **run).stdout.splitlines()
    assert dtype == "fp32" and why.startswith("auto: "), why


def test_the_cpu_preset_trains_with_auto(caplog: pytest.LogCaptureFixture) -> None:
    for name in ("cpu-tiny", "cpu-smol"):  # recipes/presets/<name>.yaml
        assert parse_args(["--preset", name]).trainer.grpo.precision == "auto"
    from trainer.model import resolve_precision

    with caplog.at_level(logging.INFO, logger="trainer.model"):
        dtype = resolve_precision("auto", CPU)
    (record,) = [r for r in caplog.records if "compute precision" in r.getMessage()]
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    assert f"compute precision {name} (auto: " in record.getMessage()

"""``--precision auto``: bf16 compute where the hardware runs it natively, else fp32.

On a CPU without native bf16 (e.g. an AVX2-only AMD EPYC) PyTorch still runs bf16 matmuls,
but oneDNN emulates them: 30-180x slower than fp32 (issue 21: 1.2 against 65.6 GFLOP/s, and
a default GRPO step that took minutes instead of seconds). So on the CPU ``auto`` is bf16 only
when both hold:

1. the CPU reports native bf16 instructions (``torch.cpu.get_capabilities()``, i.e. cpuinfo:
   ``avx512_bf16`` or ``amx_bf16`` on x86, ``bf16`` or ``sve_bf16`` on Arm), and
2. a one-off 256x256 matmul, timed single-threaded (best of 7, so the other processes of a
   shared box do not decide it), is faster in bf16 than in fp32. The flags describe the
   chip, not what the libraries use: ``ONEDNN_MAX_CPU_ISA=AVX2`` (or a VM hiding part of the
   ISA from oneDNN) keeps the flags but makes bf16 as slow as on an AVX2-only CPU, and the
   measurement catches that. So it does where bf16 runs natively but slower than fp32: a
   2-vCPU Intel Xeon VM (family 6, model 207) reports avx512_bf16 and oneDNN runs its
   ``avx512_core_bf16`` kernels, yet a bf16 matmul takes ~2x an fp32 one there
   (docs/results/trainer_precision.md). It costs a few milliseconds (about 0.5 s where bf16
   turns out emulated: 69 ms a bf16 matmul against 0.4 in fp32) and runs only when the flags
   say yes.

Without the flags the answer is fp32 at once (nothing is measured), so on a CPU without
native bf16 ``auto`` is exactly fp32 and its steps cost what fp32 steps cost. On CUDA ``auto``
is bf16 when ``torch.cuda.is_bf16_supported()``, else fp32. ``bf16``/``fp32`` are taken as
asked. The choice and its reason are logged (trainer.model.load_model).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
"""cpuinfo flags (``torch.cpu.get_capabilities()`` keys) of bf16 arithmetic in hardware."""
PROBE_SIZE = 256
PROBE_REPEATS = 7


def measure_matmul(size: int = PROBE_SIZE, repeats: int = PROBE_REPEATS) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of one ``size`` x ``size`` matmul in (fp32, bf16), one thread
    (the thread count is put back afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
        best = []
        for x, y in ((a, b), (a.bfloat16(), b.bfloat16())):
            x @ y  # warm-up: oneDNN builds its kernel on the first call
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                x @ y
                times.append(time.perf_counter() - t0)
            best.append(min(times))
        return best[0], best[1]
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class CpuBf16Source:
    """Where ``auto`` learns what the CPU can do; tests pass their own to cover every branch."""

    flags: Callable[[], Mapping[str, Any]] = torch.cpu.get_capabilities
    dispatch: Callable[[], str] = torch.backends.cpu.get_cpu_capability
    measure: Callable[[], tuple[float, float]] = measure_matmul


Bf16Kind = Literal["native", "slower", "none"]
"""bf16 on a CPU: native and faster than fp32, reported by the CPU but measured no faster
(emulated, or a native path slower than fp32), or not reported at all."""


def cpu_bf16(source: CpuBf16Source | None = None) -> tuple[Bf16Kind, str]:
    """(what bf16 is on this CPU, the reason in words)."""
    source = source or CpuBf16Source()
    flags = source.flags()
    native = [f for f in NATIVE_BF16_FLAGS if flags.get(f)]
    where = f"{flags.get('cpu_name', 'CPU')}, ATen dispatch {source.dispatch()}"
    if not native:
        return (
            "none",
            f"no native bf16 on this CPU ({where}; none of {', '.join(NATIVE_BF16_FLAGS)})",
        )
    fp32_s, bf16_s = source.measure()
    measured = (
        f"{PROBE_SIZE}x{PROBE_SIZE} matmul bf16 {bf16_s * 1e3:.3f} ms, fp32 {fp32_s * 1e3:.3f} ms"
    )
    if bf16_s < fp32_s:
        return "native", f"native bf16 ({'+'.join(native)}; {where}); {measured}"
    return "slower", (
        f"the CPU reports {'+'.join(native)} ({where}) but bf16 is not faster: "
        f"{measured} (bf16 emulated, e.g. oneDNN held to AVX2 by ONEDNN_MAX_CPU_ISA, or this "
        f"chip's native bf16 path slower than its fp32 one)"
    )


def choose_precision(
    precision: str, device: torch.device, source: CpuBf16Source | None = None
) -> tuple[torch.dtype, str]:
    """The compute dtype for ``--precision`` on ``device``, and why."""
    if precision == "bf16":
        return torch.bfloat16, "--precision bf16"
    if precision == "fp32":
        return torch.float32, "--precision fp32"
    if precision != "auto":
        raise ValueError(f"precision must be auto, bf16 or fp32 (got {precision!r})")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: CUDA device with bf16 support"
        return torch.float32, "auto: this CUDA device has no bf16 support"
    if device.type != "cpu":
        return torch.float32, f"auto: fp32 on {device.type}"
    kind, why = cpu_bf16(source)
    return (torch.bfloat16 if kind == "native" else torch.float32), f"auto: {why}"


def main(argv: list[str] | None = None) -> int:
    """Print what ``--precision`` resolves to here (``bf16`` or ``fp32``), then why. The
    launcher asks this in a child process, so it never imports torch itself."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.precision",
        description="The compute dtype --precision resolves to on this machine: prints bf16 "
        "or fp32 on the first line, the reason on the second.",
    )
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args(argv)
    dtype, why = choose_precision(args.precision, torch.device(args.device))
    print("bf16" if dtype == torch.bfloat16 else "fp32")
    print(why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

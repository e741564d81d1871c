"""The cost probe's arithmetic (launch/cost_probe.py measures, this multiplies out): what one
optimizer step of a phase computes (:class:`PhaseShape`), a measured step and its phase's
total (:class:`Estimate`), the lines the launcher prints, the evaluations' estimate at the
SFT step's FLOP rate, and, over ``LONG_RUN_S``, the cpu-tiny command the launcher offers or
runs instead (:class:`LongRun`). No torch, no model: numbers and words."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

MIN_STEPS = 5
"""A phase of this many steps or fewer is not probed (it is over before the probe would be)."""
MIN_STEP_FLOP = 1e12
"""A step under this many FLOP (6 x parameters x tokens) takes seconds on any CPU: no probe
(the tiny model's SFT step: ~2e11; SmolLM2-135M's: ~7e12)."""
MAX_PROBE_TOKENS = 2048
"""Most tokens in one timed pass; a larger micro-batch is probed with fewer rows, scaled."""
BUSY_SHARE = 0.7
"""Below this share of its threads' time the line says the CPU was busy with other work."""
LONG_RUN_S = 90 * 60.0
"""Above this (all estimates together) the launcher offers or runs the tiny preset."""


@dataclass(frozen=True)
class PhaseShape:
    """What one optimizer step of a phase computes."""

    name: str  # SFT or GRPO
    steps: int  # steps the phase has left to run
    prompt: int  # tokens the rows of a pass share first (GRPO: the group's prompt; SFT: 0)
    completion: int  # tokens of each row after it (SFT: the whole sequence)
    rows: int  # rows (sequences) in one timed pass
    passes: int  # such passes per optimizer step (micro-batches or groups)
    scoring_forwards: int = 0  # no-grad forwards per pass (GRPO's scoring, the KL reference)
    scale: float = 1.0  # real / probed rows (SFT examples: real / probed tokens)
    source: str = "random tokens"  # or the SFT's first training examples

    @property
    def tokens(self) -> int:
        """Tokens of one timed pass (its shared prefix once)."""
        return self.prompt + self.rows * self.completion

    def describe(self) -> str:
        shape = f"{self.rows} x {self.completion} tokens"
        if self.prompt:
            shape = f"{self.prompt}-token prompt + {shape}"
        scaled = f", scaled x{self.scale:.3g} to the real rows" if self.scale != 1 else ""
        return f"{shape} ({self.source}), x{self.passes} per step{scaled}"


@dataclass(frozen=True)
class Estimate:
    """A phase's measured step and what it multiplies out to."""

    shape: PhaseShape
    step_s: float
    """Seconds of one optimizer step (measured, scaled to the phase's shapes)."""
    precision: str
    """``fp32`` or ``bf16``: the compute precision the trainer will use."""
    timed_steps: int = 1
    share: float = 1.0
    """CPU time the probe's process got / (wall time x threads): < 1 where others ran."""
    bf16: str = "none"
    """What bf16 is on this CPU: ``native``, ``slower`` (reported, measured no faster than
    fp32) or ``none`` (``trainer.precision.cpu_bf16``)."""

    @property
    def total_s(self) -> float:
        return self.shape.steps * self.step_s


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


BF16_WORDS = {"native": "native bf16", "slower": "bf16 slower than fp32 here", "none": "no bf16"}


def cpu_words(precision: str, bf16: str) -> str:
    """``AMD EPYC 7B13, fp32, no bf16``: the CPU's name (/proc/cpuinfo), the precision,
    what bf16 is here (``Estimate.bf16``, in ``BF16_WORDS``)."""
    name = platform.processor() or "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {precision}, {BF16_WORDS[bf16]}"


def phase_line(est: Estimate, cpu: str) -> str:
    """``[run_all] cost on this CPU (AMD EPYC, fp32, no bf16): SFT 30 steps x ~75 s = ~38 min
    (probe: ...)``."""
    shape = est.shape
    if shape.name == "evaluation":
        return (
            f"[run_all] cost on this CPU ({cpu}): {shape.steps} evaluations of {shape.rows} "
            f"steps x ~{_duration(est.step_s)} = ~{_duration(est.total_s)} ({shape.source})"
        )
    only = " (trainer compute only, not sampling)" if shape.name == "GRPO" else ""
    busy = ""
    if est.share < BUSY_SHARE:
        busy = f"; the CPU was busy: the probe got {est.share:.0%} of its threads' time"
    return (
        f"[run_all] cost on this CPU ({cpu}): {shape.name} {shape.steps} steps x "
        f"~{_duration(est.step_s)} = ~{_duration(est.total_s)}{only} "
        f"(probe: {est.timed_steps} step(s) of {shape.describe()}{busy})"
    )


class LongRun(Exception):
    """The probe measured the run at over ``LONG_RUN_S`` and ``launch.long_run`` is ``tiny``:
    the launcher runs ``argv`` (:func:`tiny_argv`) instead."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(shlex.join(argv))
        self.argv = argv


def tiny_command(argv: Sequence[str]) -> str:
    """The run's command with the tiny preset (:func:`tiny_argv`), as a shell line."""
    return shlex.join(["launch/run_all.sh", *tiny_argv(argv)])


def tiny_argv(argv: Sequence[str]) -> list[str]:
    """The run's launcher options with the tiny preset: its ``--preset``, ``--recipe``/
    ``--config`` (a recipe names its model), ``--run-dir``, ``--resume`` and ``--long-run``
    (the tiny model's steps are not probed; ``make run`` passes ``--long-run tiny`` and a
    user's ``RUN_ARGS`` may add another) left out."""
    from launch.run_config import without_options  # not at import: the probe's child needs none

    valued = ["--preset", "--recipe", "--config", "--run-dir", "--launch.run-dir"]
    valued += ["--long-run", "--launch.long-run"]
    rest = without_options(argv, valued, ["--resume", "--launch.resume"])
    return ["--preset", "cpu-tiny", *rest]


def long_run_lines(
    estimates: Sequence[Estimate], preset: str, argv: Sequence[str], switch: bool = False
) -> list[str]:
    """Why the run is long and the cpu-tiny command, when the estimates together exceed
    ``LONG_RUN_S``, then what the launcher does (``switch``: runs that command instead);
    nothing otherwise."""
    total = sum(e.total_s for e in estimates)
    if total <= LONG_RUN_S:
        return []
    parts = " + ".join(f"{e.shape.name} ~{_duration(e.total_s)}" for e in estimates)
    steps = " and ".join(
        f"~{e.step_s:.0f} s a {e.shape.name} step in {e.precision}"
        for e in estimates
        if e.shape.name != "evaluation"
    )
    return [
        f"[run_all] NOTE: preset {preset} would take ~{_duration(total)} on this CPU "
        f"({parts}), over {LONG_RUN_S / 60:.0f} min: its model's steps are measured at {steps} "
        f"(fp32 where bf16 is not native or measured no faster, trainer/precision.py).",
        "[run_all] NOTE: the tiny preset runs the same pipeline on the project's own 4-layer "
        "model, seconds a step (24-40 min in all on 2 cores, docs/RUNNING.md): "
        + tiny_command(argv),
        f"[run_all] NOTE: running the tiny preset instead, as --long-run tiny asks (what make run "
        f"asks; --long-run warn keeps {preset})."
        if switch
        else f"[run_all] NOTE: continuing with {preset} as asked (--no-cost-probe skips this "
        "probe; --long-run tiny would run the tiny preset instead).",
    ]


def evaluation_estimate(
    sft: Estimate, params: int, samples: int, tokens: int, evaluations: int = 2
) -> Estimate:
    """The run's evaluations (``evaluations`` of ``samples`` steps of at most ``tokens``
    tokens: prompt budget + answer budget), at the FLOP rate the SFT step reached on this CPU
    (forwards: 2 x parameters a token; the evaluations also compute alone, on every core, in
    the trainer's precision). Full budgets: an upper bound, as GRPO's."""
    rate = step_flop(sft.shape, params) / sft.step_s
    shape = PhaseShape("evaluation", evaluations, 0, tokens, samples, 1)
    shape = replace(shape, source="at the SFT step's FLOP rate, full budgets: an upper bound")
    return Estimate(shape, 2.0 * params * samples * tokens / rate, sft.precision, 0)


def param_count(model_dir: str | Path) -> int:
    """Parameters in ``model_dir``'s safetensors files, read from their JSON headers (0 if
    none): no tensor library is imported."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def step_flop(shape: PhaseShape, params: int) -> float:
    """6 x parameters x tokens of one optimizer step (forward + backward)."""
    return 6.0 * params * shape.tokens * shape.scale * shape.passes


def sft_shape(sft: Any, steps: int) -> PhaseShape:
    """An SFT step (``SftConfig``): ``batch_size / micro_batch_size`` micro-batches."""
    rows = sft.micro_batch_size
    probed = max(1, min(rows, MAX_PROBE_TOKENS // sft.max_seq_len))
    passes = sft.batch_size // sft.micro_batch_size
    return PhaseShape("SFT", steps, 0, sft.max_seq_len, probed, passes, 0, rows / probed)


def grpo_shape(grpo: Any, group_size: int, prompt: int, completion: int, steps: int) -> PhaseShape:
    """A GRPO step (``GrpoConfig``): its groups, packed; several micro-batches add the
    scoring forward, a KL reference model its own forward."""
    groups = max(1, grpo.batch_size // group_size)
    probed = max(1, min(group_size, (MAX_PROBE_TOKENS - prompt) // max(1, completion)))
    tokens = groups * (prompt + group_size * completion)
    several = tokens > grpo.micro_batch_tokens
    reference = grpo.kl_beta > 0 and grpo.kl_reference == "model"
    extra = int(several) + int(reference)
    return PhaseShape("GRPO", steps, prompt, completion, probed, groups, extra, group_size / probed)

"""What the run's long phases will cost on this CPU, measured before they start (issue 46).

CPUs differ by more than the presets' comments can say: the cpu-smol SFT took ~28 s a step on
a CPU with native bf16 (avx512_bf16) and 60-100 s in fp32 on an AVX2-only AMD EPYC. So before
SFT (and GRPO) start on a CPU trainer, the launcher loads the model the phase trains the way
the trainer does (``trainer.model.load_model``: the phase's precision, attention, packing,
LoRA, frozen layers), with the trainer's thread count (launch/threads.py), and times one real
optimizer step at the phase's shapes on synthetic tokens, after one small warm-up step:

- SFT: one micro-batch of ``micro_batch_size`` rows of ``max_seq_len`` tokens (the first
  examples the SFT will draw when the dataset is there, else random tokens, which share no
  prefix and so cost more), times ``batch_size / micro_batch_size``, plus one AdamW step.
- GRPO: one group (``env.group_size`` completions of ``env.max_tokens`` after a shared prompt
  of ``env.max_prompt_tokens``, packed as the trainer packs it; full lengths: an upper bound)
  times the step's groups, plus the scoring forward (several micro-batches) and the KL
  reference's forward where they run, and one AdamW step. The trainer's compute only:
  sampling (vLLM) and weight syncs come on top.

A pass holds at most ``MAX_PROBE_TOKENS`` tokens: a larger micro-batch is probed with fewer
rows, scaled linearly (the line says so). The times are wall-clock: where other work held
the CPU, the line says what share of its threads the probe got. The run's evaluations are
estimated at the FLOP rate the SFT step reached (forwards of their full budgets: an upper
bound). Over ``LONG_RUN_S`` (all of these together) the launcher says why and prints the
cpu-tiny command, then does what ``launch.long_run`` says: goes on (``warn``: the user chose)
or runs that command instead (``tiny``: what ``make run`` asks).
No probe with ``launch.cost_probe: false``, a GPU trainer or several trainer processes, a
phase of ``MIN_STEPS`` steps or fewer, or a step under ``MIN_STEP_FLOP`` (the tiny model).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
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
    scale: float = 1.0  # real rows / probed rows (> 1: probed with fewer rows)
    source: str = "random tokens"  # or the SFT's first training examples

    @property
    def tokens(self) -> int:
        """Tokens of one timed pass (its shared prefix once)."""
        return self.prompt + self.rows * self.completion

    def describe(self) -> str:
        shape = f"{self.rows} x {self.completion} tokens"
        if self.prompt:
            shape = f"{self.prompt}-token prompt + {shape}"
        scaled = f", scaled x{self.scale:.3g} to the real rows" if self.scale > 1 else ""
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
    native_bf16: bool = False
    """Whether the CPU runs bf16 matmuls natively (trainer/precision.py)."""

    @property
    def total_s(self) -> float:
        return self.shape.steps * self.step_s


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def cpu_words(precision: str, native_bf16: bool) -> str:
    """``AMD EPYC 7B13, fp32, no bf16``: the CPU's name (/proc/cpuinfo), the precision,
    whether bf16 is native."""
    name = platform.processor() or "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {precision}, {'native bf16' if native_bf16 else 'no bf16'}"


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
    ``--config`` (a recipe names its model), ``--run-dir`` and ``--resume`` left out."""
    valued = {"--preset", "--recipe", "--config", "--run-dir", "--launch.run-dir"}
    flags = {"--resume", "--launch.resume"}
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in valued:
            skip = True
            continue
        if a in flags or a.split("=", 1)[0] in valued:
            continue
        rest.append(a)
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
        f"(fp32 where the CPU has no native bf16, trainer/precision.py).",
        f"[run_all] NOTE: the tiny preset runs the same pipeline in minutes: {tiny_command(argv)}",
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


def measure_in_child(
    phase_cfg: Any, model_dir: str | Path, shape: PhaseShape, threads: int | None, log: Path
) -> Estimate:
    """:func:`launch.cost_measure.measure_phase` in a child process (``python -m
    launch.cost_measure``): the launcher never imports torch nor holds the model it probed.
    The child dies with the launcher (``launch.procs``) and logs to ``log``."""
    from launch.procs import ManagedProcess, tail

    with tempfile.TemporaryDirectory(prefix="cost_probe-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        kind = "sft" if shape.name == "SFT" else "grpo"
        request.write_text(
            json.dumps(
                {
                    "kind": kind,
                    "config": phase_cfg.model_dump(mode="json"),
                    "model_dir": str(model_dir),
                    "shape": asdict(shape),
                    "threads": threads,
                }
            )
        )
        argv = [sys.executable, "-m", "launch.cost_measure", str(request), str(result)]
        rc = ManagedProcess("cost_probe", argv, log).run_to_exit(stall=1800, limit=3600)
        if rc != 0 or not result.exists():
            raise RuntimeError(f"the probe process exited {rc}: {tail(log, 5).strip()}")
        out = json.loads(result.read_text())
    return Estimate(**{**out, "shape": PhaseShape(**out["shape"])})


def steps_left(cfg: Any) -> int:
    """Steps the trainer with ``cfg`` will still run: all of them, or on ``resume`` what its
    newest checkpoint leaves (0 when it is done; an unreadable one counts as none)."""
    total = int(cfg.training_steps)
    if cfg.resume not in (True, "latest"):
        return total
    from trainer.checkpoint_files import checkpoint_step
    from trainer.resume import resume_checkpoint

    try:
        ckpt = resume_checkpoint(cfg)
        done = checkpoint_step(ckpt) if ckpt is not None else 0
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        done = 0
    return max(0, total - done)


class CostProbe:
    """The launcher's probe of one run (``cfg``: its ``RunConfig`` resolved for the run;
    ``argv``: its command line, for the cpu-tiny command; ``trainer_env``: what the thread
    plan gives the GRPO trainer, whose ``OMP_NUM_THREADS`` the GRPO probe's torch uses; the
    SFT runs alone in the launcher's environment, and so does its probe). :meth:`before_sft` estimates SFT and GRPO at once (the
    GRPO probe then runs on the base model: the same architecture as the SFT model it will
    train), :meth:`before_grpo` repeats the GRPO line, or probes GRPO when SFT did not run.
    A probe that fails says so and the run goes on."""

    def __init__(
        self,
        cfg: Any,
        argv: Sequence[str],
        trainer_env: Mapping[str, str] | None = None,
        measure: Any = None,
    ) -> None:
        lc = cfg.launch
        self.cfg, self.argv = cfg, list(argv)
        log = Path(lc.run_dir or tempfile.gettempdir()) / "cost_probe.log"
        self.measure = measure or partial(measure_in_child, log=log)
        omp = (trainer_env or {}).get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        self.threads = int(omp) if omp and omp.isdigit() else None  # GRPO's
        omp = os.environ.get("OMP_NUM_THREADS")
        self.sft_threads = int(omp) if omp and omp.isdigit() else None  # the SFT's
        self.enabled = lc.cost_probe and lc.trainer_device == "cpu" and lc.trainer_procs == 1
        self.grpo: Estimate | None = None
        self.grpo_probed = False
        self.too_long = False
        """Over ``LONG_RUN_S`` with ``long_run: tiny``: the next check raises :class:`LongRun`."""
        self.cpu = ""

    def _shape(self, name: str, steps: int) -> PhaseShape:
        cfg = self.cfg
        if name == "SFT":
            return sft_shape(cfg.trainer.sft, steps)
        env = cfg.env
        return grpo_shape(
            cfg.trainer.grpo, env.group_size, env.max_prompt_tokens, env.max_tokens, steps
        )

    def _estimate(self, name: str, phase_cfg: Any, model_dir: str) -> Estimate | None:
        steps = steps_left(phase_cfg)
        if steps <= MIN_STEPS or not Path(model_dir).is_dir():
            return None
        shape = self._shape(name, steps)
        if step_flop(shape, param_count(model_dir)) < MIN_STEP_FLOP:
            return None  # seconds a step: not worth a probe
        # the SFT runs alone, with the launcher's environment (torch's threads: every core);
        # the GRPO trainer shares the cores with vLLM, with the thread plan's share
        n = self.threads if name == "GRPO" else self.sft_threads
        threads = f"{n} thread(s)" if n else "torch's threads"
        print(f"[run_all] cost probe: timing a {name} step on this CPU ({threads})...", flush=True)
        est = self.measure(phase_cfg, model_dir, shape, n)
        self.cpu = self.cpu or cpu_words(est.precision, est.native_bf16)
        return est

    def _run(self, phases: list[tuple[str, Any, str]]) -> list[str]:
        """The lines for ``phases`` ((name, phase config, model directory)), probed."""
        if not self.enabled:
            return []
        t0 = time.monotonic()
        try:
            found = [(n, self._estimate(n, c, m)) for n, c, m in phases]
        except Exception as e:  # noqa: BLE001 -- an estimate must never stop the run
            return [f"[run_all] cost probe failed ({type(e).__name__}: {e}); continuing"]
        estimates = [e for _, e in found if e is not None]
        self.grpo_probed |= any(n == "GRPO" for n, _, _ in phases)
        self.grpo = next((e for n, e in found if n == "GRPO"), self.grpo)
        if not estimates:
            return []
        lines = [phase_line(e, self.cpu) for e in estimates]
        lines[-1] += f" [probe took {time.monotonic() - t0:.0f} s]"
        lc, env = self.cfg.launch, self.cfg.env
        sft = [(e, m) for (n, e), (_, _, m) in zip(found, phases, strict=True) if n == "SFT" and e]
        if sft and lc.eval_samples and lc.shop_r1_env:  # at the rate the SFT step reached
            (est, model), tokens = sft[0], env.max_prompt_tokens + env.max_tokens
            estimates.append(evaluation_estimate(est, param_count(model), lc.eval_samples, tokens))
            lines.append(phase_line(estimates[-1], self.cpu))
        switch = lc.long_run == "tiny" and self.cfg.preset != "cpu-tiny"
        long = long_run_lines(estimates, self.cfg.preset, self.argv, switch)
        self.too_long = switch and bool(long)
        return lines + long

    def before_sft(self) -> list[str]:
        """Before the SFT cold start: SFT's, GRPO's and the evaluations' estimates, printed."""
        cfg = self.cfg
        base = str(cfg.launch.base_model)
        phases = [("SFT", cfg.trainer.sft, base), ("GRPO", cfg.trainer.grpo, base)]
        return self._say(self._run(phases))

    def before_grpo(self) -> list[str]:
        """Before the GRPO trainer starts: its estimate (probed now if SFT did not run)."""
        if self.grpo is not None:
            return _print([phase_line(self.grpo, self.cpu)])
        if self.grpo_probed:  # skipped (or failed) before SFT: not again
            return []
        grpo = self.cfg.trainer.grpo
        return self._say(self._run([("GRPO", grpo, str(grpo.model_name))]))

    def _say(self, lines: list[str]) -> list[str]:
        """Print ``lines``; then, where the run is too long and ``long_run: tiny``, raise
        :class:`LongRun` with the cpu-tiny command (nothing of this phase trained yet)."""
        _print(lines)
        if self.too_long:
            raise LongRun(tiny_argv(self.argv))
        return lines


def _print(lines: list[str]) -> list[str]:
    for line in lines:
        print(line, flush=True)
    return lines

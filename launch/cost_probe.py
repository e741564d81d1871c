"""What the run's long phases will cost on this CPU, measured before they start (issue 46).

CPUs differ by more than the presets' comments can say: the cpu-smol SFT took ~28 s a step on
a CPU with native bf16 (avx512_bf16) and 60-100 s in fp32 on an AVX2-only AMD EPYC. So before
SFT (and GRPO) start on a CPU trainer, the launcher loads the model the phase trains the way
the trainer does (``trainer.model.load_model``: the phase's precision, attention, packing,
LoRA, frozen layers), with the trainer's thread count (launch/threads.py), and times one real
optimizer step at the phase's shapes on synthetic tokens, after one small warm-up step:

- SFT: one micro-batch of ``micro_batch_size`` rows of ``max_seq_len`` tokens (random
  tokens, which share no prefix and so cost more), times ``batch_size / micro_batch_size``,
  plus one AdamW step. Where the dataset is there, the first examples the SFT will draw
  instead, scaled by tokens to rows of the mean length of the first 256 it draws.
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
The arithmetic and the lines: launch/cost_estimate.py.
No probe with ``launch.cost_probe: false``, a GPU trainer or several trainer processes, a
phase of ``MIN_STEPS`` steps or fewer, or a step under ``MIN_STEP_FLOP`` (the tiny model).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from launch.cost_estimate import (
    MIN_STEP_FLOP,
    MIN_STEPS,
    Estimate,
    LongRun,
    PhaseShape,
    cpu_words,
    evaluation_estimate,
    grpo_shape,
    long_run_lines,
    param_count,
    phase_line,
    sft_shape,
    step_flop,
    tiny_argv,
)


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
    SFT runs alone in the launcher's environment, and so does its probe; ``run_dir``: the
    run's directory, where the probe process logs, ``cost_probe.log``). :meth:`before_sft` estimates SFT and GRPO at once (the
    GRPO probe then runs on the base model: the same architecture as the SFT model it will
    train), :meth:`before_grpo` repeats the GRPO line, or probes GRPO when SFT did not run.
    A probe that fails says so and the run goes on."""

    def __init__(
        self,
        cfg: Any,
        argv: Sequence[str],
        trainer_env: Mapping[str, str] | None = None,
        measure: Any = None,
        run_dir: Path | None = None,
    ) -> None:
        lc = cfg.launch
        self.cfg, self.argv = cfg, list(argv)
        self.log = Path(run_dir or lc.run_dir or tempfile.gettempdir()) / "cost_probe.log"
        self.measure = measure or partial(measure_in_child, log=self.log)
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
        self.cpu = self.cpu or cpu_words(est.precision, est.bf16)
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

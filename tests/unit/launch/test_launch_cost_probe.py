"""launch/cost_probe.py: the measured step on the tiny model, the estimate it multiplies out
to, the launcher's lines, and the >90 min branch (a per-step time injected, nothing slept)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from launch import cost_estimate, cost_probe
from launch.cost_estimate import (
    Estimate,
    LongRun,
    PhaseShape,
    cpu_words,
    grpo_shape,
    long_run_lines,
    phase_line,
    sft_shape,
    tiny_command,
)
from launch.cost_measure import measure_phase, measure_step, sft_examples
from launch.cost_probe import CostProbe, measure_in_child
from launch.run_config import resolve_run
from trainer.config import GrpoConfig, SftConfig

pytestmark = pytest.mark.unit


def test_probe_measures_a_positive_step_and_multiplies_it_out(tiny_model_dir: Path) -> None:
    sft = SftConfig(
        model_name=str(tiny_model_dir),
        precision="fp32",
        batch_size=4,
        micro_batch_size=2,
        max_seq_len=32,
        training_steps=30,
    )
    shape = sft_shape(sft, 30)
    assert (shape.rows, shape.passes, shape.completion) == (2, 2, 32)
    est = measure_step(sft, tiny_model_dir, shape, threads=1)
    assert est.step_s > 0 and est.precision == "fp32" and 0 < est.share <= 1
    assert est.total_s == pytest.approx(30 * est.step_s)


def test_grpo_probe_packs_a_group_and_counts_its_extra_forwards(tiny_model_dir: Path) -> None:
    grpo = GrpoConfig(
        model_name=str(tiny_model_dir),
        precision="fp32",
        batch_size=4,
        micro_batch_tokens=32,
        kl_beta=0.05,
        training_steps=10,
    )
    shape = grpo_shape(grpo, group_size=2, prompt=16, completion=8, steps=10)
    # 2 groups of (16 + 2 x 8) tokens > 32: a scoring pass, and the KL reference's forward
    assert (shape.passes, shape.rows, shape.scoring_forwards, shape.tokens) == (2, 2, 2, 32)
    est = measure_step(grpo, tiny_model_dir, shape, threads=1)
    assert est.step_s > 0
    assert est.total_s == pytest.approx(10 * est.step_s)


def test_a_large_micro_batch_is_probed_with_fewer_rows_and_scaled() -> None:
    sft = SftConfig(batch_size=16, micro_batch_size=16, max_seq_len=2048)
    shape = sft_shape(sft, 100)
    assert shape.rows == cost_estimate.MAX_PROBE_TOKENS // 2048
    assert shape.rows * shape.scale == 16
    assert f"scaled x{16 // shape.rows}" in shape.describe()


def _estimate(name: str, steps: int, step_s: float) -> Estimate:
    shape = PhaseShape(name, steps, 0, 1024, 8, 1)
    return Estimate(shape, step_s, "fp32")


def test_the_line_names_the_cpu_precision_and_numbers() -> None:
    line = phase_line(_estimate("SFT", 30, 75.0), "AMD EPYC, fp32, no bf16")
    assert line.startswith("[run_all] cost on this CPU (AMD EPYC, fp32, no bf16): ")
    assert "SFT 30 steps x ~75 s = ~38 min" in line
    assert "probe: 1 step(s) of 8 x 1024 tokens (random tokens)" in line
    assert "busy" not in line
    busy = Estimate(PhaseShape("SFT", 30, 0, 1024, 8, 1), 75.0, "fp32", share=0.2)
    assert "the CPU was busy: the probe got 20% of its threads' time" in phase_line(busy, "X")
    assert cpu_words("fp32", "slower").endswith(", fp32, bf16 slower than fp32 here")
    assert cpu_words("fp32", "none").endswith(", fp32, no bf16")
    assert cpu_words("bf16", "native").endswith(", bf16, native bf16")
    grpo = phase_line(_estimate("GRPO", 30, 70.0), "X")
    assert "trainer compute only, not sampling" in grpo


def test_over_90_minutes_prints_why_and_the_tiny_preset_command() -> None:
    argv = ["--preset", "cpu-smol", "--run-dir", "runs/x", "--training-steps", "40"]
    slow = [_estimate("SFT", 30, 100.0), _estimate("GRPO", 40, 100.0)]
    lines = long_run_lines(slow, "cpu-smol", argv)
    text = "\n".join(lines)
    assert "~1.9 h" in text and "over 90 min" in text and "fp32" in text
    assert "launch/run_all.sh --preset cpu-tiny --training-steps 40" in text
    assert "continuing with cpu-smol" in text
    assert long_run_lines([_estimate("SFT", 30, 10.0)], "cpu-smol", argv) == []


def test_tiny_command_drops_the_preset_recipe_run_dir_resume_and_long_run() -> None:
    argv = [
        "--preset=cpu-smol",
        "--long-run",  # make run's, then the user's (RUN_ARGS): neither matters to tiny
        "tiny",
        "--recipe",
        "r.yaml",
        "--resume",
        "--run-dir=runs/a",
        "--seed",
        "3",
        "--launch.long-run=warn",
    ]
    assert tiny_command(argv) == "launch/run_all.sh --preset cpu-tiny --seed 3"


def _smol_like(tmp_path: Path, model_dir: Path, *flags: str):
    """cpu-smol's shapes and steps over the tiny model's files (no SmolLM2 needed)."""
    argv = ["--preset", "cpu-smol", "--base-model", str(model_dir), *flags]
    argv += ["--trainer.sft.save-path", str(tmp_path / "sft")]
    argv += ["--trainer.grpo.save-path", str(tmp_path / "grpo")]
    argv += ["--trainer.sft.data-dir", str(tmp_path / "no-data")]  # random tokens
    return argv, resolve_run(argv)


def test_the_launcher_probe_prints_both_phases_and_the_tiny_command(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(cost_probe, "MIN_STEP_FLOP", 0.0)  # the tiny model stands in for Smol
    argv, cfg = _smol_like(tmp_path, tiny_model_dir, "--training-steps", "30")
    calls: list[tuple[str, int]] = []

    def measured(phase_cfg, model_dir, shape, threads):
        calls.append((shape.name, threads))
        return Estimate(shape, 120.0, "fp32")

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    probe = CostProbe(cfg, argv, {"OMP_NUM_THREADS": "1"}, measure=measured)
    lines = probe.before_sft()
    # the SFT runs alone with the launcher's environment (torch's threads), GRPO with its share
    assert calls == [("SFT", None), ("GRPO", 1)]
    assert "SFT 30 steps x ~2 min = ~60 min" in lines[0]
    assert "GRPO 30 steps x ~2 min = ~60 min" in lines[1]
    assert any("--preset cpu-tiny" in line for line in lines)
    out = capsys.readouterr().out
    assert out.count("[run_all] cost probe: timing a ") == 2  # before each measurement
    assert all(line in out for line in lines)
    again = probe.before_grpo()  # the GRPO line again, not measured again
    assert again == [lines[1].split(" [probe took")[0]] and len(calls) == 2


def test_no_probe_when_off_short_or_the_steps_take_seconds(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    def never(*_a):
        raise AssertionError("probed")

    for flags in (["--no-cost-probe"], ["--sft-steps", "5", "--training-steps", "5"], []):
        argv, cfg = _smol_like(tmp_path, tiny_model_dir, *flags)
        probe = CostProbe(cfg, argv, {}, measure=never)  # [] : the tiny model's steps are cheap
        assert probe.before_sft() == [] and probe.before_grpo() == []


def test_a_failing_probe_says_so_and_the_run_goes_on(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cost_probe, "MIN_STEP_FLOP", 0.0)
    argv, cfg = _smol_like(tmp_path, tiny_model_dir)

    def broken(*_a):
        raise RuntimeError("no memory")

    lines = CostProbe(cfg, argv, {}, measure=broken).before_sft()
    assert lines == ["[run_all] cost probe failed (RuntimeError: no memory); continuing"]


def test_without_a_dataset_sft_is_probed_on_random_tokens(tmp_path: Path) -> None:
    sft = SftConfig(data_dir=str(tmp_path / "none"))
    assert sft_examples(sft, tmp_path, 2) is None


def test_sft_is_probed_on_its_first_examples_scaled_by_tokens(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first examples the SFT draws are timed, and scaled to a micro-batch by tokens: to
    rows of the mean length of the first ``LENGTH_SAMPLE`` it draws, not of the first few."""
    from env_server.data.dataset import load_or_build
    from trainer.model import load_tokenizer
    from trainer.sft_data import LazySplit

    monkeypatch.setattr("launch.cost_measure.LENGTH_SAMPLE", 24)
    load_or_build(tmp_path / "data", 12, seed=0)
    sft = SftConfig(
        model_name=str(tiny_model_dir),
        precision="fp32",
        data_dir=str(tmp_path / "data"),
        num_sessions=12,
        batch_size=8,
        micro_batch_size=8,
        max_seq_len=1024,
        training_steps=30,
    )
    # what trainer/sft.py draws first, in its order: the lengths the scale must come from
    tok = load_tokenizer(str(tiny_model_dir))
    split = LazySplit(load_or_build(tmp_path / "data", 12)["train"], tok, 1024, False)
    drawn = [len(e.tokens) for e in split.take(split.order(sft.seed, 0)[:24])]
    assert len(drawn) == 24 and sum(drawn) / 24 != drawn[0]  # rows alone would scale wrong
    rows, mean = sft_examples(sft, tiny_model_dir, 2)
    assert [len(t) for t, _ in rows] == drawn[:2] and mean == pytest.approx(sum(drawn) / 24)
    shape = PhaseShape("SFT", 30, 0, 1024, 1, 1, 0, 8.0)  # one row probed, unlike sft_shape
    est = measure_phase(sft, tiny_model_dir, shape, threads=1)
    assert (est.shape.rows, est.shape.completion) == (1, drawn[0])
    assert est.shape.scale == pytest.approx(8 * mean / drawn[0])
    assert f"rows {mean:.0f} tokens on average over the first 24" in est.shape.describe()
    assert f"scaled x{est.shape.scale:.3g} to the real rows" in est.shape.describe()


def test_the_probe_runs_in_a_child_process_that_reads_the_phase_config(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The launcher's default: the measurement in ``python -m launch.cost_measure`` (the
    launcher imports no torch); the GRPO config, its loss union included, crosses as JSON."""
    grpo = GrpoConfig(
        model_name=str(tiny_model_dir), precision="fp32", batch_size=4, training_steps=10
    )
    shape = grpo_shape(grpo, group_size=2, prompt=16, completion=8, steps=10)
    est = measure_in_child(grpo, tiny_model_dir, shape, 1, tmp_path / "cost_probe.log")
    assert est.shape == shape and est.step_s > 0 and est.precision == "fp32"
    assert est.total_s == pytest.approx(10 * est.step_s)
    with pytest.raises(RuntimeError, match="the probe process exited 1"):
        measure_in_child(grpo, tmp_path / "no-model", shape, 1, tmp_path / "bad.log")


def test_long_run_tiny_runs_the_tiny_preset_instead(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``--long-run tiny`` (``make run``): over 90 min the probe says why and hands the
    launcher the cpu-tiny command, before anything is trained; under it the run goes on."""
    monkeypatch.setattr(cost_probe, "MIN_STEP_FLOP", 0.0)
    argv, cfg = _smol_like(tmp_path, tiny_model_dir, "--long-run", "tiny", "--seed", "3")

    def at(step_s: float):
        return lambda phase_cfg, model_dir, shape, threads: Estimate(shape, step_s, "fp32")

    assert len(CostProbe(cfg, argv, {}, measure=at(10.0)).before_sft()) == 3  # ~14 min
    with pytest.raises(LongRun) as e:  # SFT 75 + GRPO 25 min + the evaluations
        CostProbe(cfg, argv, {}, measure=at(150.0)).before_sft()
    assert e.value.argv[:2] == ["--preset", "cpu-tiny"] and "--seed" in e.value.argv
    out = capsys.readouterr().out
    assert "over 90 min" in out and "running the tiny preset instead" in out
    warn = resolve_run([*argv, "--long-run", "warn"])  # the default: the user chose
    lines = CostProbe(warn, argv, {}, measure=at(150.0)).before_sft()
    assert "continuing with cpu-smol as asked" in lines[-1]


def test_the_launcher_runs_the_tiny_preset_in_the_same_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the launcher does with :class:`LongRun`: the services it started are stopped, and
    the cpu-tiny command runs in the same run directory (nothing was trained there)."""
    from launch import run_all

    runs: list[tuple[str, Path]] = []

    def launch(cfg, plan, stack, argv):
        runs.append((cfg.preset, plan.run_dir))
        if cfg.preset == "cpu-smol":
            raise LongRun(cost_estimate.tiny_argv(argv))
        return 0

    monkeypatch.setattr(run_all, "launch", launch)
    run_dir = tmp_path / "run"
    argv = ["--preset", "cpu-smol", "--long-run", "tiny", "--run-dir", str(run_dir)]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:  # main() ignores both signals at its end: a child started later would inherit that
        rc = run_all.main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert rc == 0 and runs == [("cpu-smol", run_dir), ("cpu-tiny", run_dir)]


def test_the_probe_logs_in_the_run_dir_the_launcher_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cost_probe.log`` lands in the run's directory also where no ``--run-dir`` was given
    (``make run``: the launcher names it ``runs/<timestamp>``), not in the temp dir."""
    from launch import run_all

    seen: list[tuple[Path, Path]] = []

    def prepare(cfg, plan, probe):
        seen.append((probe.log, plan.run_dir))
        return []

    monkeypatch.setattr(run_all, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(run_all, "prepare", prepare)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = run_all.main(["--preset", "cpu-smol", "--prepare-only", "--no-fork-services"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    [(log, run_dir)] = seen
    assert rc == 0 and run_dir.parent == tmp_path / "runs"
    assert log == run_dir / "cost_probe.log"


def test_the_evaluations_are_estimated_at_the_sft_steps_flop_rate() -> None:
    """Two evaluations of 512 steps of 1,024 tokens (forwards: 2 FLOP a parameter a token)
    at the rate an SFT step of 8 x 1,024 tokens (6 FLOP a parameter a token) reached."""
    sft = Estimate(PhaseShape("SFT", 30, 0, 1024, 8, 1), 30.0, "bf16")
    params = 135_000_000
    rate = 6.0 * params * 8 * 1024 / 30.0
    est = cost_estimate.evaluation_estimate(sft, params, 512, 1024)
    assert est.step_s == pytest.approx(2.0 * params * 512 * 1024 / rate)  # 640 s
    assert est.total_s == pytest.approx(2 * est.step_s)
    line = phase_line(est, "AMD EPYC, bf16, native bf16")
    assert "2 evaluations of 512 steps x ~11 min = ~21 min" in line and "upper bound" in line
    slow = Estimate(sft.shape, 150.0, "bf16")  # 75 min of SFT: with the evaluations, > 90
    note = long_run_lines([slow, est], "cpu-smol", [])[0]
    assert "~1.6 h on this CPU (SFT ~75 min + evaluation ~21 min)" in note
    assert "~150 s a SFT step in bf16 (" in note  # the evaluations have no step time

"""The hint ``launch/run_all.sh`` prints when a run stops (a failure, Ctrl-C): the command that
continues it, and what that ``--resume`` will do from the state the run was stopped in
(``launch.prepare.resume_plan``), one test per state: nothing done, SFT mid-way with and
without a checkpoint, SFT done, GRPO mid-way with a checkpoint, GRPO done; plus an incomplete
checkpoint, a run on another model and the reused SFT evaluation. Each state is made of the
files the run would have left; the hint resolves the resume's command line as the launch
will (launch/configs.py), so the SFT's own resume follows its checkpoints folder as there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.prepare import resume_hint
from settings import paths

pytestmark = pytest.mark.unit
SFT_STEPS, GRPO_STEPS = 30, 3
FLAGS = ["--sft-steps", str(SFT_STEPS), "--training-steps", str(GRPO_STEPS), "--eval-samples", "0"]


@pytest.fixture
def art(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty artifacts folder the cpu-tiny preset's paths point at (``${ARTIFACTS}``), and
    the env's dataset folder in it."""
    root = tmp_path / "artifacts"
    monkeypatch.setattr(paths, "ARTIFACTS", root)
    monkeypatch.setenv("SHOP_R1_ENV__DATA_DIR", str(root / "data" / "shop_r1"))
    return root


def _hint(run_dir: Path, *extra: str, flags: list[str] = FLAGS) -> str:
    """The second line of the hint, after ``--resume: ``."""
    text = resume_hint(run_dir, ["--run-dir", str(run_dir), *flags, *extra])
    first, second = text.splitlines()
    assert first == (
        f"[run_all] to continue this run: launch/run_all.sh --resume --run-dir {run_dir} "
        + " ".join([*flags, *extra])
    )
    assert second.startswith("[run_all]   --resume: "), second
    return second.split("--resume: ", 1)[1]


def _built(art: Path) -> None:
    """The base model and the dataset, as their builds leave them."""
    (art / "models" / "tiny-qwen2").mkdir(parents=True)
    (art / "models" / "tiny-qwen2" / "config.json").write_text("{}")
    (art / "data" / "shop_r1").mkdir(parents=True)
    (art / "data" / "shop_r1" / "test.jsonl").write_text("")


def _sft_done(art: Path) -> None:
    (art / "models" / "tiny-qwen2-sft").mkdir(parents=True, exist_ok=True)
    (art / "models" / "tiny-qwen2-sft" / "model.safetensors").write_bytes(b"")


def _checkpoint(save_path: Path, step: int, complete: bool = True) -> Path:
    """``<save_path>/checkpoints/step_<step>`` with what trainer/checkpoint.py writes."""
    ckpt = save_path / "checkpoints" / f"step_{step:06d}"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (ckpt / "model" / "model.safetensors").write_bytes(b"")
    for name in ("scheduler.pt", "rng.pt", *(["optimizer.pt"] if complete else [])):
        (ckpt / name).write_bytes(b"")
    return ckpt


def test_nothing_done(art: Path, tmp_path: Path) -> None:
    """Stopped while the base model was being built: everything is still to do."""
    assert _hint(tmp_path / "run") == (
        "the base model and the dataset are built; SFT starts from step 0 (30 steps; no "
        "checkpoint yet); GRPO has not started"
    )


def test_sft_midway_with_a_checkpoint(art: Path, tmp_path: Path) -> None:
    """The case of issue 48: Ctrl-C during the cpu-smol SFT (30 steps, a checkpoint every
    10) at step 12, its one checkpoint at step 10."""
    (art / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    (art / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    (art / "data" / "shop_r1").mkdir(parents=True)
    (art / "data" / "shop_r1" / "test.jsonl").write_text("")
    _checkpoint(art / "models" / "smollm2-135m-instruct-sft", 10)
    assert _hint(tmp_path / "run", flags=["--preset", "cpu-smol"]) == (
        "the base model and the dataset are reused; SFT resumes from its step-10 checkpoint "
        "(20 steps left); GRPO has not started; the SFT and RL evaluations run"
    )
    _checkpoint(art / "models" / "smollm2-135m-instruct-sft", 20)  # the newest one counts
    assert "SFT resumes from its step-20 checkpoint (10 steps left)" in _hint(
        tmp_path / "run", flags=["--preset", "cpu-smol"]
    )


def test_sft_midway_without_a_checkpoint(art: Path, tmp_path: Path) -> None:
    """Stopped before the SFT's first checkpoint: SFT starts over (an empty checkpoints
    folder, which makes the launcher pass the SFT ``--resume``, too)."""
    _built(art)
    (art / "models" / "tiny-qwen2-sft").mkdir(parents=True)
    want = (
        "the base model and the dataset are reused; SFT starts from step 0 (30 steps; no "
        "checkpoint yet); GRPO has not started"
    )
    assert _hint(tmp_path / "run") == want
    (art / "models" / "tiny-qwen2-sft" / "checkpoints").mkdir()
    assert _hint(tmp_path / "run") == want


def test_sft_done(art: Path, tmp_path: Path) -> None:
    """SFT finished (its checkpoints may still be there), GRPO had not checkpointed."""
    _built(art)
    _checkpoint(art / "models" / "tiny-qwen2-sft", 30)
    _sft_done(art)
    assert _hint(tmp_path / "run") == (
        "the base model and the dataset are reused; SFT is done (its model is reused); GRPO "
        "starts from step 0 (3 steps; no checkpoint yet)"
    )


def test_grpo_midway_with_a_checkpoint(art: Path, tmp_path: Path) -> None:
    _built(art)
    _sft_done(art)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir / "trainer", 1)
    _checkpoint(run_dir / "trainer", 2)
    assert _hint(run_dir) == (
        "the base model and the dataset are reused; SFT is done (its model is reused); GRPO "
        "resumes from its step-2 checkpoint (1 step left)"
    )


def test_grpo_done(art: Path, tmp_path: Path) -> None:
    """Stopped after the trainer's last step (in the RL evaluation, say)."""
    _built(art)
    _sft_done(art)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir / "trainer", 3)
    assert _hint(run_dir) == (
        "the base model and the dataset are reused; SFT is done (its model is reused); GRPO "
        "has done its 3 steps (step_000003): only its final weights are synced to vLLM again"
    )


def test_an_incomplete_checkpoint_is_named(art: Path, tmp_path: Path) -> None:
    """What trainer/run.py refuses to resume, the hint does not promise."""
    _built(art)
    _sft_done(art)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir / "trainer", 1)
    _checkpoint(run_dir / "trainer", 2, complete=False)
    assert _hint(run_dir).endswith(
        "GRPO stops at once: its newest checkpoint, step_000002, is incomplete (missing "
        "optimizer.pt (or dcp/.metadata); move it aside to resume from the one before)"
    )


def test_another_model_has_no_preparation(art: Path, tmp_path: Path) -> None:
    """``--model`` other than the preset's: the launcher builds nothing, runs no SFT."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir / "trainer", 2)
    hint = _hint(run_dir, "--model", str(tmp_path / "hub-model"))
    assert hint == "GRPO resumes from its step-2 checkpoint (1 step left)"


def test_the_sft_evaluation_is_read_back(
    art: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _built(art)
    _sft_done(art)
    run_dir = tmp_path / "run"
    auto = ["--eval-samples", "4", "--eval-server", "own", "--eval-dtype", "auto"]
    with monkeypatch.context() as m:  # no SFT evaluation to compare: `auto` is not resolved
        m.setattr("launch.prepare.eval_dtype", lambda *a: pytest.fail("dtype resolved"))
        assert _hint(run_dir, *auto).endswith("; the SFT and RL evaluations run")
    assert _hint(run_dir, "--eval-samples", "4").endswith("; the SFT and RL evaluations run")
    (run_dir / "eval_sft").mkdir(parents=True)
    (run_dir / "eval_sft" / "metrics.json").write_text("{}")
    assert _hint(run_dir, "--eval-samples", "4").endswith(
        "; the SFT evaluation is read back, the RL evaluation runs"
    )
    # an evaluation of another split is not read back for this one (its rows differ)
    (run_dir / "eval_sft" / "metrics.json").write_text('{"split": "validation"}')
    assert _hint(run_dir, "--eval-samples", "4").endswith("; the SFT and RL evaluations run")
    assert _hint(run_dir, "--eval-samples", "4", "--eval-split", "validation").endswith(
        "; the SFT evaluation is read back, the RL evaluation runs"
    )
    # nor one served in another dtype than the RL evaluation will be (launch.eval_dtype)
    bf16 = ["--eval-samples", "4", "--eval-server", "own", "--eval-dtype", "bfloat16"]
    (run_dir / "eval_sft" / "metrics.json").write_text("{}")  # the run's servers' dtype
    assert _hint(run_dir, *bf16).endswith("; the SFT and RL evaluations run")
    (run_dir / "eval_sft" / "metrics.json").write_text('{"server_dtype": "bfloat16"}')
    assert _hint(run_dir, *bf16).endswith(
        "; the SFT evaluation is read back, the RL evaluation runs"
    )


def test_a_verifiers_run_without_shop_r1_has_no_dataset_nor_sft(art: Path, tmp_path: Path) -> None:
    """The guess-the-number recipe (a verifiers env instead of Shop-R1's): stopped during its
    held-out evaluation before training, nothing but the base model to build or reuse."""
    recipe = paths.REPO_ROOT / "recipes" / "smollm2-135m-instruct" / "guess_number"
    flags = ["--preset", "cpu-smol", "--recipe", str(recipe / "multiturn.yaml")]
    (art / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    (art / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    assert _hint(tmp_path / "run", flags=flags) == (
        "the base model is reused; GRPO starts from step 0 (40 steps; no checkpoint yet); the "
        "verifiers env's held-out evaluation before training runs"
    )
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "eval_verifiers_before.jsonl").write_text("")
    assert _hint(run, flags=flags).endswith("held-out evaluation before training is read back")


@pytest.mark.parametrize(
    "given",
    [
        ["--launch.run-dir", "{run}"],
        ["--launch.run-dir={run}"],
        ["--run-dir={run}", "--no-resume"],
        ["--run-dir", "{run}", "--launch.run-dir", "{run}", "--no-launch.resume"],
    ],
)
def test_the_hint_names_the_run_dir_and_resume_once(
    art: Path, tmp_path: Path, given: list[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = [a.format(run=run_dir) for a in given] + FLAGS
    first = resume_hint(run_dir, argv).splitlines()[0]
    assert first == (
        f"[run_all] to continue this run: launch/run_all.sh --resume --run-dir {run_dir} "
        + " ".join(FLAGS)
    )

"""The sharded trainer (torchrun + FSDP2 on gloo, 2 ranks) on the embedded tiny model.

(a) One GRPO step on the same batch gives the same weights at 2 ranks as one process, and
    so does a second step (with clipping active): within 1e-5 absolute (fp32 sums in another
    order; measured 1.3e-6 after two steps at lr 1e-3, docs/TRAINER.md). Full and LoRA.
    After the step, the gather leaves rank 0's weight-sync replica (what the bridge sends)
    bitwise equal to the trained weights.
(b) A sharded checkpoint resumes exactly: at 2 ranks the loaded weights and AdamW state are
    bitwise those saved and the next step is bitwise the uninterrupted one; at 1 rank (a
    plain process, no torch.distributed) the loaded state is bitwise the same; a one-process
    checkpoint resumes at 2 ranks bitwise too. The checkpoint's ``model/`` is a normal HF
    directory that transformers loads with the trained weights.

Each run is a job of ``tests/integration/fsdp_worker.py`` (the trainer's own ``start_run``
and ``grpo_step`` on fixed batches), under ``torchrun --standalone`` or as one process. The
module runs them all in three processes (``runs``, a module fixture): every 2-rank job that
starts from the model, then every one-process job, then the 2-rank resumes, one job after
another in each process. They were thirteen processes, one per run, and their start-up
(imports, the process group) was most of the module's time. Each job still builds its run
afresh with ``start_run`` (seeds, model, optimizer, resume from disk), and no resume runs in
the process that wrote its checkpoint. The full-weights step test and the checkpoint test
share their two save runs (the same job: ``save``, clip 0.1, full weights), which each ran
once for itself before.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from launch.procs import ManagedProcess
from tests.integration.fsdp_worker import JOB_SEP

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent.with_name("fsdp_worker.py")
TOL = 1e-5
CLIP = {"full": 0.1, "lora": 0.02}  # below the first steps' gradient norms: clipping acts


def launch(model: Path, root: Path, procs: int, jobs: dict[str, list[str]]) -> None:
    """Run ``jobs`` (name: mode and flags) one after another in one process at ``procs``
    ranks (1: a plain process); job ``name`` saves under ``root/name``, rank 0 writes its
    snapshots to ``root/name.pt``."""
    args: list[str] = [str(WORKER)]
    for name, (mode, *extra) in jobs.items():
        args += [JOB_SEP] if len(args) > 1 else []
        args += ["--mode", mode, "--model", str(model), "--save", str(root / name)]
        args += ["--out", str(root / f"{name}.pt"), *extra]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    argv = [sys.executable, *(launcher if procs > 1 else []), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a plain process must not look like a torchrun rank
    log = root / f"{'+'.join(jobs)}.{procs}.log"
    proc = ManagedProcess(f"fsdp-{procs}", argv, log, env=env).start()
    try:
        rc = proc.popen.wait(timeout=1800)
    finally:
        proc.stop()
    assert rc == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of the module, by job name: rank 0's snapshots, and ``root`` (their dirs)."""
    root = tmp_path_factory.mktemp("fsdp")
    first: dict[str, list[str]] = {}
    for kind in ("full", "lora"):
        lora = ["--lora"] if kind == "lora" else []
        first[f"save_{kind}"] = ["save", "--max-grad-norm", str(CLIP[kind]), *lora]
        first[f"grads_{kind}"] = ["grads", "--shared-prompts", *lora]
    launch(tiny_model_dir, root, 2, {f"{n}_2": job for n, job in first.items()})
    one = {f"{n}_1": list(job) for n, job in first.items()}
    for kind in ("full", "lora"):  # packed at 2 ranks against padded in one process
        one[f"grads_{kind}_1"] += ["--packing", "padded"]

    def resume_from(src: str, name: str) -> list[str]:
        shutil.copytree(root / src / "checkpoints", root / name / "checkpoints")
        return ["resume"]

    one["resume_2to1"] = resume_from("save_full_2", "resume_2to1")
    launch(tiny_model_dir, root, 1, one)
    last = {
        "resume_2to2": resume_from("save_full_2", "resume_2to2"),
        "resume_1to2": resume_from("save_full_1", "resume_1to2"),  # one process into 2 ranks
    }
    launch(tiny_model_dir, root, 2, last)
    names = [*(f"{n}_2" for n in first), *one, *last]
    return {"root": root, **{n: torch.load(root / f"{n}.pt", weights_only=False) for n in names}}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["model"].keys() == b["model"].keys()
    diffs = [(a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]]
    assert a["optim"].keys() == b["optim"].keys()
    for k, state in a["optim"].items():
        for n, v in state.items():
            diffs.append((v - b["optim"][k][n]).abs().max().item())
    return max(diffs)


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k, state in a["optim"].items():
        for n, v in state.items():
            assert torch.equal(v, b["optim"][k][n]), (k, n)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_ranks_step_like_one_process(runs: dict[str, Any], kind: str) -> None:
    one, two = runs[f"save_{kind}_1"], runs[f"save_{kind}_2"]
    for tag in ("after1", "after2"):
        s1, s2 = one[tag]["stats"], two[tag]["stats"]
        assert s1["tokens"] == s2["tokens"] == 114
        assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-6)
        assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-4)  # fp32 norm sums
        assert s2["grad_norm"] > CLIP[kind]
        assert max_diff(one[tag], two[tag]) < TOL
    for name, value in two["replica"].items():  # what rank 0 hands the bridge: the weights
        assert torch.equal(value, two["after1"]["model"][name]), name
    assert len(two["replica"]) >= len(two["after1"]["model"]) - 1  # all but a tied lm_head
    start = {k: v for k, v in one["after1"]["model"].items()}
    assert any(not torch.equal(start[k], v) for k, v in one["after2"]["model"].items())


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_ranks_packed_like_one_process_padded(runs: dict[str, Any], kind: str) -> None:
    """Packed prefix trees (trainer/prefix_tree/) at 2 ranks against padded rows in one
    process, on groups that share their prompts: the loss and every parameter's gradient of
    one step (gathered whole), within fp32 tolerance."""
    one, two = runs[f"grads_{kind}_1"], runs[f"grads_{kind}_2"]
    s1, s2 = one["stats"], two["stats"]
    assert s1["tokens"] == s2["tokens"]
    assert s2["forward_tokens"] < s2["sequence_tokens"] <= s1["forward_tokens"]
    assert s2["micro_batches"] >= 2  # both ranks have real work
    for key in ("loss", "kl", "entropy", "self_certainty"):
        assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-7), key
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for name, g in one["grads"].items():
        assert g.abs().max() > 0 or "lora_A" in name, name  # LoRA's B starts at 0: A gets none
        assert (g - two["grads"][name]).abs().max() < 1e-6, name


def test_sharded_checkpoint_resumes_exactly_at_1_and_2_ranks(runs: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    root = runs["root"]
    straight = runs["save_full_2"]
    ckpt = root / "save_full_2" / "checkpoints" / "step_000001"
    assert (ckpt / "dcp" / ".metadata").is_file()
    hf = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    for name, p in hf.named_parameters():  # the export is the trained step-1 weights
        assert torch.equal(p.detach(), straight["after1"]["model"][name]), name

    at2 = runs["resume_2to2"]
    assert at2["loaded"]["step"] == 1
    assert_bitwise(at2["loaded"], straight["after1"])
    assert_bitwise(at2["after2"], straight["after2"])  # the next step, bitwise
    at1 = runs["resume_2to1"]
    assert_bitwise(at1["loaded"], straight["after1"])
    assert max_diff(at1["after2"], straight["after2"]) < TOL

    single = runs["save_full_1"]
    assert not (root / "save_full_1" / "checkpoints" / "step_000001" / "dcp").exists()
    up = runs["resume_1to2"]  # a one-process checkpoint into 2 ranks
    assert_bitwise(up["loaded"], single["after1"])
    assert max_diff(up["after2"], single["after2"]) < TOL

"""The pure parts of bench/peers/same_batch.py and compare_updates.py: how a sampled completion
is cut, the cosines, and AdamW's replay (the comparison against TRL itself runs in
tests/integration/bench/test_same_batch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.peers.compare_updates import adamw_updates, cosines
from bench.peers.same_batch import same_settings, side_settings, truncate_at_eos
from bench.peers.settings import resolve_plan

pytestmark = pytest.mark.unit


def test_a_completion_ends_at_its_first_eos() -> None:
    assert truncate_at_eos([5, 6, 2, 0, 0], eos=[2], pad=0) == [5, 6, 2]
    assert truncate_at_eos([5, 2, 7, 2], eos=[2, 7], pad=None) == [5, 2]
    assert truncate_at_eos([5, 6, 0, 0], eos=[2], pad=0) == [5, 6]  # the budget ran out
    assert truncate_at_eos([5, 6, 2, 2], eos=[2], pad=2) == [5, 6, 2]  # pad is EOS


def test_cosines_over_the_model_and_per_tensor() -> None:
    a = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([3.0])}
    b = {"w": torch.tensor([2.0, 0.0]), "b": torch.tensor([-3.0])}
    got = cosines(a, b)
    assert got["cosine"] == pytest.approx((2 - 9) / (10**0.5 * 13**0.5))
    assert (got["norm_ours"], got["norm_trl"]) == pytest.approx((10**0.5, 13**0.5))
    assert got["tensor_cosine_min"] == pytest.approx(-1.0) and got["worst_tensor"] == "b"
    assert got["tensor_cosine_median"] == pytest.approx(0.0)  # the median of 1 and -1
    assert got["tensors"] == got["tensors_nonzero_in_both"] == 2
    b["w"] = torch.zeros(2)  # a tensor without a gradient on one side is left out per tensor
    assert cosines(a, b)["tensors_nonzero_in_both"] == 1
    with pytest.raises(ValueError, match="different tensors"):
        cosines(a, {"w": b["w"]})
    with pytest.raises(ValueError, match="no learning signal"):
        cosines(a, {"w": torch.zeros(2), "b": torch.zeros(1)})


def test_adams_first_step_is_a_sign_but_near_eps() -> None:
    g = torch.tensor([2.0, -3.0, 1e-8, 0.0])
    (got,) = adamw_updates([g], [0.5], (0.9, 0.999), eps=1e-8)
    assert got.tolist() == pytest.approx([-0.5, 0.5, -0.25, 0.0], rel=1e-6)


def test_the_replay_is_torchs_adamw_step_by_step() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, 3) * s for s in (1.0, 0.3, 2.0)]
    lrs = [1e-2, 1e-2, 5e-3]
    w = torch.nn.Parameter(torch.randn(5, 3))
    start = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=lrs[0], betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)
    got = adamw_updates(grads, lrs, (0.9, 0.99), eps=1e-6)
    for g, lr, replayed in zip(grads, lrs, got, strict=True):
        opt.param_groups[0]["lr"] = lr
        w.grad = g.clone()
        opt.step()
        assert torch.allclose(replayed, (w.detach() - start).double(), atol=1e-6), replayed


def test_compare_steps_replays_both_runs_and_names_our_clipping(tmp_path) -> None:
    """Two synthetic runs of three AdamW steps whose gradients point the same way but differ
    in length (ours ~10x TRL's, clipped at 1; TRL's never): the gradient cosines are 1, the
    replay on ours' clipped gradients gives the measured update cosine, and with the lengths
    made equal the updates are the same."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from bench.peers.compare_updates import compare_steps

    grpo = SimpleNamespace(
        max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0
    )
    plan = SimpleNamespace(grpo=grpo)
    torch.manual_seed(0)
    shapes = {"a": (4, 3), "b": (5,)}
    grads = [{n: torch.randn(s) * (1 + k) for n, s in shapes.items()} for k in range(3)]
    lengths = {"ours": [10.0, 0.8, 3.0], "trl": [0.5, 0.04, 0.15]}  # ours clipped in steps 1, 3
    results = {}
    for side, norms in lengths.items():
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
        opt = torch.optim.AdamW(
            params.values(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0
        )
        steps = []
        for k, g in enumerate(grads):
            total = sum(float(x.pow(2).sum()) for x in g.values()) ** 0.5
            raw = {n: x * (norms[k] / total) for n, x in g.items()}
            for n, p in params.items():
                p.grad = raw[n].clone()
            norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), grpo.max_grad_norm))
            seen = raw if side == "ours" else {n: p.grad.clone() for n, p in params.items()}
            opt.step()
            tensors = {f"grad/{n}": seen[n] for n in shapes}
            tensors |= {f"update/{n}": params[n].detach().clone() for n in shapes}
            (tmp_path / side).mkdir(exist_ok=True)
            save_file(tensors, str(tmp_path / side / f"step{k}.safetensors"))
            steps.append({"lr": 1e-2, "stats": {"grad_norm": norm}})
        results[side] = {"steps": steps}

    got = compare_steps(tmp_path, results["ours"], results["trl"], plan)
    assert len(got) == 3
    for k, step in enumerate(got):
        assert step["gradient"]["cosine"] == pytest.approx(1.0, abs=1e-12)
        replay = step["adamw_replayed"]
        assert replay["predicted"] == pytest.approx(step["update"]["cosine"], abs=1e-7), k
        assert replay["same_length"] == pytest.approx(1.0, abs=1e-12), k
    assert [s["adamw_replayed"]["ours_clip_factor"] for s in got] == pytest.approx(
        [0.1, 1.0, 1 / 3], rel=1e-5
    )
    # clipping turned the later updates: the step-1 clip changed how much step 1 weighs
    assert got[2]["update"]["cosine"] < 1 - 1e-4
    assert got[2]["adamw_replayed"]["unclipped"] > got[2]["update"]["cosine"]


def test_a_finished_side_is_reused_only_with_its_settings(tmp_path: Path) -> None:
    """``--reuse-work-dir``: a side's recorded settings must equal the run's (none recorded:
    run again). Ours' depend on its loss (``--trl-normaliser``), TRL's do not; paths are left
    out of both."""
    kw = dict(preset="cpu-tiny", steps=2, keep=1)
    token = resolve_plan(1, run_dir=tmp_path / "a", **kw)
    constant = resolve_plan(1, True, run_dir=tmp_path / "b", **kw)
    for side, differ in (("ours", True), ("trl", False)):
        a, b = side_settings(token, side, False, 8), side_settings(constant, side, False, 8)
        assert (a != b) is differ, side
        recorded = tmp_path / side / "settings.json"
        assert not same_settings(recorded, a)  # none recorded: not known to match
        recorded.parent.mkdir()
        recorded.write_text(json.dumps(a))
        assert same_settings(recorded, a)
        assert same_settings(recorded, b) is not differ
    assert side_settings(token, "trl", False, 8) != side_settings(token, "trl", False, 4)

"""How two trainers' steps on the same batches compare (``bench/peers/same_batch.py``): the
cosine of two models' worth of tensors (``Cosine``, ``cosines``), AdamW replayed on a
tensor's gradients step by step (``adamw_updates``), and the per-step comparison of two saved
runs (``compare_steps``), read tensor by tensor so that a SmolLM2 run of several steps fits in
memory."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from bench.peers.settings import Plan


class Cosine:
    """The cosine of two vectors given tensor by tensor (``add``), with the per-tensor cosines
    of the tensors nonzero in both."""

    def __init__(self) -> None:
        self.dot = self.na = self.nb = 0.0
        self.count = 0
        self.per: dict[str, float] = {}

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double().flatten(), y.double().flatten()
        d, sx, sy = float(x @ y), float(x @ x), float(y @ y)
        self.dot, self.na, self.nb, self.count = (
            self.dot + d,
            self.na + sx,
            self.nb + sy,
            self.count + 1,
        )
        if sx > 0 and sy > 0:
            self.per[name] = d / (sx * sy) ** 0.5

    def result(self) -> dict[str, Any]:
        """The cosine, both norms, and the per-tensor cosines' min, median and worst tensor."""
        if self.na == 0 or self.nb == 0:
            raise ValueError("a vector is zero: no learning signal in the batch")
        worst = min(self.per, key=self.per.__getitem__)
        return {
            "cosine": self.dot / (self.na * self.nb) ** 0.5,
            "norm_ours": self.na**0.5,
            "norm_trl": self.nb**0.5,
            "tensors": self.count,
            "tensors_nonzero_in_both": len(self.per),
            "tensor_cosine_min": self.per[worst],
            "tensor_cosine_median": statistics.median(self.per.values()),
            "worst_tensor": worst,
        }


def cosines(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The cosine of ``a`` and ``b`` as two vectors over every tensor, their norms, and the
    per-tensor cosines (min, median, the worst tensor's name) over tensors nonzero in both."""
    if set(a) != set(b):
        raise ValueError(f"different tensors: {sorted(set(a) ^ set(b))[:5]}")
    acc = Cosine()
    for name in sorted(a):
        acc.add(name, a[name], b[name])
    return acc.result()


def adamw_updates(
    grads: Sequence[torch.Tensor], lrs: Sequence[float], betas: tuple[float, float], eps: float
) -> list[torch.Tensor]:
    """The parameter update since the start after each of AdamW's steps on ``grads`` (one
    tensor's gradients, step by step, as the optimizer got them), without weight decay. Its
    first step is ``-lr * g / (|g| + eps)``: a sign, except where ``|g|`` is near eps."""
    import torch

    b1, b2 = betas
    m = torch.zeros_like(grads[0], dtype=torch.float64)
    v, total, out = torch.zeros_like(m), torch.zeros_like(m), []
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        g = g.double()
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v / (1 - b2**t)).sqrt_().add_(eps)
        total.add_(m / denom, alpha=-lr / (1 - b1**t))
        out.append(total.clone())
    return out


PREDICTIONS = {
    "predicted": "ours' gradients as its optimizer got them (clipped at max_grad_norm)",
    "unclipped": "ours' gradients before clipping",
    "same_length": "ours' gradients rescaled, step by step, to the length of TRL's",
}
"""AdamW runs on ours' gradients compared with the AdamW run on TRL's (``compare_steps``):
``predicted`` should match the measured update cosine; the others say what is left of the
difference without our clipping, or with equal lengths (then only the directions differ)."""


def compare_steps(
    work: Path, ours: Mapping[str, Any], trl: Mapping[str, Any], plan: Plan
) -> list[dict[str, Any]]:
    """Per step of the two runs saved under ``work/ours`` and ``work/trl``
    (``bench/peers/one_step.py``): the cosine of the two gradients (each on its own side's
    weights), of the two updates since the start, and of AdamW replayed on TRL's gradients and
    on ours' (``PREDICTIONS``). Read tensor by tensor, so a SmolLM2 run of several steps fits."""
    from safetensors import safe_open

    g = plan.grpo
    n = len(ours["steps"])
    limit = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
    clip = [min(1.0, limit / (s["stats"]["grad_norm"] + 1e-6)) for s in ours["steps"]]  # torch's
    lrs = [s["lr"] for s in trl["steps"]]
    betas = (g.adam_beta1, g.adam_beta2)
    files = {
        side: [safe_open(str(work / side / f"step{k}.safetensors"), "pt") for k in range(n)]
        for side in ("ours", "trl")
    }
    names = sorted(k[5:] for k in files["ours"][0].keys() if k.startswith("grad/"))
    grad = [Cosine() for _ in range(n)]
    update = [Cosine() for _ in range(n)]
    replay = {key: [Cosine() for _ in range(n)] for key in PREDICTIONS}
    for name in names:
        go = [f.get_tensor(f"grad/{name}") for f in files["ours"]]
        gt = [f.get_tensor(f"grad/{name}") for f in files["trl"]]  # read after TRL's clip
        for k in range(n):
            grad[k].add(name, go[k], gt[k])
            update[k].add(
                name,
                files["ours"][k].get_tensor(f"update/{name}"),
                files["trl"][k].get_tensor(f"update/{name}"),
            )
    same = [(c.nb / c.na) ** 0.5 for c in grad]  # TRL's gradient length over ours', per step
    scales = {"predicted": clip, "unclipped": [1.0] * n, "same_length": same}
    for name in names:
        go = [f.get_tensor(f"grad/{name}") for f in files["ours"]]
        gt = [f.get_tensor(f"grad/{name}") for f in files["trl"]]
        want = adamw_updates(gt, lrs, betas, g.adam_eps)
        for key, scale in scales.items():
            got = adamw_updates(
                [x * c for x, c in zip(go, scale, strict=True)], lrs, betas, g.adam_eps
            )
            for k in range(n):
                replay[key][k].add(name, got[k], want[k])
    return [
        {
            "gradient": grad[k].result(),
            "update": update[k].result(),
            "adamw_replayed": {key: replay[key][k].result()["cosine"] for key in PREDICTIONS}
            | {"ours_clip_factor": clip[k], "weight_decay_left_out": g.weight_decay},
        }
        for k in range(n)
    ]

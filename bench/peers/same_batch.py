"""Same batch, both trainers: the gradient and the one-step update of this stack's GRPO step
and of TRL's GRPOTrainer (trl==1.16.0) on one identical batch (issue 46 point 5: after the
same samples TRL had learned more in every seed; is that in the update rule, or in what each
side sampled?).

    flock /tmp/heavy.lock .venv/bin/python -m bench.peers.same_batch --model SFT_DIR \\
        --preset cpu-smol --batches 3

Each batch holds the preset's ``prompts_per_step`` train rows (the env's order, continuing
across batches) with ``group_size`` completions each, sampled once by transformers
``generate`` from ``--model`` at the preset's temperature, top-p and completion budget
(seeded), and scored by the env's reward (``bench/peers/data.py``). Then, from the same
start weights:

- ours: ``trainer.grpo_step.accumulate`` on those sequences with the preset's resolved
  ``GrpoConfig`` (prefix-tree packing, self-certainty off as in the peer bench), every group
  kept (TRL trains constant groups at advantage 0; ours' env would drop them), the inference
  logprobs marked missing so the trainer's own stand in (ratio 1, as TRL's on-policy ratio
  without vLLM); then ``clip_and_step``.
- TRL: ``GRPOTrainer.train`` for one step on the same prompts (``trl_args``: dr_grpo, group
  scaling, the same AdamW, clip and schedule), its generation replaced by the same
  completions (``_generate_single_turn`` returns them; TRL decodes, rewards, computes the
  advantages, the loss and the optimizer step itself). Its gradient is read when the
  optimizer is about to step (after TRL's clip, which does not turn it).

Each side's step runs in a fresh process (``bench/peers/one_step.py``).

Compared per batch: the cosine of the two gradients over the whole model and per tensor, their
norms (before clipping), the rewards each side computed, and the cosine of the two parameter
updates after the one AdamW step, with the updates AdamW's first step predicts from each side's
gradient (``update_check``: whether the updates differ only where a gradient's length meets
Adam's eps). Both sides compute in the precision our trainer picks on this
CPU (``--precision auto``). Written: ``--out`` (JSON) and ``table.md`` beside it. The loss
normalisers differ by a constant (ours: the step's trained tokens; TRL ``dr_grpo``: sequences
x max_completion_length), as do the advantage scales (ours: population std; TRL: sample std),
so the gradients may differ in length, not in direction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import RESULTS, machine, write_result

if TYPE_CHECKING:
    import torch

    from bench.peers.settings import Plan


def truncate_at_eos(ids: Sequence[int], eos: Sequence[int], pad: int | None) -> list[int]:
    """A sampled completion as both trainers see it: up to and including the first EOS token,
    else the whole budget without trailing padding."""
    out: list[int] = []
    for t in ids:
        out.append(int(t))
        if t in eos:
            return out
    while out and pad is not None and out[-1] == pad and pad not in eos:
        out.pop()
    return out


def cosines(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The cosine of ``a`` and ``b`` as two vectors over every tensor, their norms, and the
    per-tensor cosines (min, median, the worst tensor's name) over tensors nonzero in both."""
    if set(a) != set(b):
        raise ValueError(f"different tensors: {sorted(set(a) ^ set(b))[:5]}")
    dot = na = nb = 0.0
    per: dict[str, float] = {}
    for name in sorted(a):
        x, y = a[name].double().flatten(), b[name].double().flatten()
        d, sx, sy = float(x @ y), float(x @ x), float(y @ y)
        dot, na, nb = dot + d, na + sx, nb + sy
        if sx > 0 and sy > 0:
            per[name] = d / (sx * sy) ** 0.5
    if na == 0 or nb == 0:
        raise ValueError("a vector is zero: no learning signal in the batch")
    worst = min(per, key=per.__getitem__)
    return {
        "cosine": dot / (na * nb) ** 0.5,
        "norm_ours": na**0.5,
        "norm_trl": nb**0.5,
        "tensors": len(a),
        "tensors_nonzero_in_both": len(per),
        "tensor_cosine_min": per[worst],
        "tensor_cosine_median": statistics.median(per.values()),
        "worst_tensor": worst,
    }


def adam_first_step(grads: Mapping[str, torch.Tensor], eps: float) -> dict[str, torch.Tensor]:
    """AdamW's first update per unit of learning rate, without weight decay: the bias-corrected
    moments are g and g^2, so it is g / (|g| + eps) -- a sign, except where |g| is near eps."""
    return {n: g.double() / (g.double().abs() + eps) for n, g in grads.items()}


def update_check(ours: Mapping[str, Any], trl: Mapping[str, Any], plan: Plan) -> dict[str, float]:
    """Whether the two AdamW updates differ only through the gradients' lengths: the cosine of
    the first steps predicted from each side's clipped gradient (it should match the measured
    update cosine), and the same with ours' gradient rescaled to TRL's length (it should be 1
    if the gradients point the same way)."""
    g = plan.grpo
    limit = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
    scale = min(1.0, limit / (ours["stats"]["grad_norm"] + 1e-6))  # torch's clip factor
    mine = {n: x * scale for n, x in ours["grads"].items()}
    theirs = trl["grads"]  # read after TRL's clip
    length = sum(float(x.double().pow(2).sum()) for x in theirs.values()) ** 0.5
    mine_len = sum(float(x.double().pow(2).sum()) for x in mine.values()) ** 0.5
    same_length = {n: x * (length / mine_len) for n, x in mine.items()}
    eps, want = g.adam_eps, adam_first_step(theirs, g.adam_eps)
    return {
        "predicted_update_cosine": cosines(adam_first_step(mine, eps), want)["cosine"],
        "same_length_update_cosine": cosines(adam_first_step(same_length, eps), want)["cosine"],
        "clipped_length_ratio": mine_len / length,
        "weight_decay_left_out": g.weight_decay,
    }


def sample_batch(
    model: Any, tok: Any, rows: list[dict[str, Any]], plan: Plan, seed: int
) -> list[dict[str, Any]]:
    """``group_size`` completions of each row's prompt by transformers ``generate`` at the
    env's sampling settings, scored by the env's reward. One dict per prompt: ``row``,
    ``prompt`` (ids), ``completions`` (ids), ``scores``."""
    import torch

    from bench.peers.data import ShopR1Reward
    from env_server.rollout import prompt_ids

    env = plan.env
    reward = ShopR1Reward(env.reward_config())
    eos = [tok.eos_token_id] if isinstance(tok.eos_token_id, int) else list(tok.eos_token_id)
    out = []
    for i, row in enumerate(rows):
        ids = prompt_ids(row, tok, env.max_prompt_tokens, env.latest_only)
        torch.manual_seed(seed * 1000 + i)
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=True,
                temperature=env.temperature,
                top_p=env.top_p,
                top_k=0,
                max_new_tokens=env.max_tokens,
                num_return_sequences=plan.group_size,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
        comps = [truncate_at_eos(g[len(ids) :].tolist(), eos, tok.pad_token_id) for g in gen]
        texts = tok.batch_decode(comps, skip_special_tokens=True)
        scores = reward([""] * len(texts), texts, [row["action"]] * len(texts))
        out.append({"row": row, "prompt": ids, "completions": comps, "scores": scores})
    return out


def one_batch(
    plan: Plan, model: str, batch: list[dict[str, Any]], work: Path, micro: int
) -> dict[str, Any]:
    """Both sides on ``batch``, each in a fresh process (so neither inherits the other's
    memory), and what they did compared."""
    from bench.common import run_child
    from bench.peers.one_step import SIDES, load_tensors
    from bench.peers.settings import compute_precision

    bf16, why = compute_precision(plan)
    work.mkdir(parents=True, exist_ok=True)
    (work / "batch.json").write_text(json.dumps(batch))
    spec = {"argv": plan.run_all_argv, "model": model, "batch": str(work / "batch.json")}
    spec |= {"bf16": bf16, "micro": micro}
    side = {
        name: run_child("bench.peers.one_step", spec | {"side": name, "work": str(work / name)})
        for name in SIDES
    }
    ours, trl = side["ours"], side["trl"]
    ours |= load_tensors(work / "ours")
    trl |= load_tensors(work / "trl")
    scores = [s for p in batch for s in p["scores"]]
    return {
        "prompts": len(batch),
        "completions": len(scores),
        "constant_groups": sum(len(set(p["scores"])) == 1 for p in batch),
        "reward_mean": statistics.fmean(scores),
        "completion_tokens_mean": statistics.fmean(len(c) for p in batch for c in p["completions"]),
        "precision": {"ours": ours["precision"], "trl": trl["precision"], "why": why},
        "lr": {"ours": ours["lr"], "trl": trl["lr"]},
        "seconds": {"ours": ours["seconds"], "trl": trl["seconds"]},
        "ours": ours["stats"],
        "trl": trl["stats"],
        "gradient": cosines(ours["grads"], trl["grads"]),
        "update": cosines(ours["update"], trl["update"]),
        "adamw_first_step": update_check(ours, trl, plan),
    }


def markdown(result: Mapping[str, Any]) -> str:
    lines = [
        f"{result['preset']}, model `{result['model']}`, {result['machine'].get('cpu')}, "
        f"{result['batches'][0]['precision']['ours']} (ours) / "
        f"{result['batches'][0]['precision']['trl']} (TRL)",
        "",
        "| batch | constant groups | reward mean | gradient cosine (tensor min / median) | "
        "grad norm ours / TRL | update cosine (tensor min) | AdamW's first step predicted: "
        "update cosine / same-length gradients |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, b in enumerate(result["batches"]):
        g, u, p = b["gradient"], b["update"], b["adamw_first_step"]
        lines.append(
            f"| {i} | {b['constant_groups']} of {b['prompts']} | {b['reward_mean']:.3f} | "
            f"{g['cosine']:.6f} ({g['tensor_cosine_min']:.4f} / "
            f"{g['tensor_cosine_median']:.6f}) | {b['ours']['grad_norm']:.4g}"
            f" / {b['trl']['grad_norm']:.4g} | {u['cosine']:.6f} ({u['tensor_cosine_min']:.4f}) | "
            f"{p['predicted_update_cosine']:.6f} / {p['same_length_update_cosine']:.6f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.peers.same_batch",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="the start checkpoint (an SFT model folder)")
    ap.add_argument("--preset", default="cpu-smol", help="whose settings both sides take")
    ap.add_argument("--batches", type=int, default=3, help="batches, each from the start model")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (and the run's)")
    ap.add_argument(
        "--trl-micro-batch", type=int, default=8, help="completions per TRL forward/backward"
    )
    ap.add_argument("--work-dir", type=Path, default=Path("runs/same_batch"))
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "peer_same_batch" / "result.json",
        help="the result (JSON, under the preset's key); the table goes beside it (table.md)",
    )
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.peers.data import rows_in_env_order
    from bench.peers.settings import resolve, run_all_argv

    work = a.work_dir.resolve()
    argv = run_all_argv(a.preset, work / "plan", None, 1, 1, str(a.model), seed=a.seed)
    plan = resolve(argv, 1)
    env = plan.env
    n = plan.prompts_per_step
    rows = rows_in_env_order(env.data_dir, env.num_sessions, env.seed, n * a.batches)
    tok = AutoTokenizer.from_pretrained(a.model)
    sampler = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    batches = []
    for b in range(a.batches):
        t0 = time.perf_counter()
        batch = sample_batch(sampler, tok, rows[b * n : (b + 1) * n], plan, a.seed * 100 + b)
        sampled = time.perf_counter() - t0
        result = one_batch(plan, str(a.model), batch, work / f"batch{b}", a.trl_micro_batch)
        result["seconds"]["sampling"] = sampled
        batches.append(result)
        g = result["gradient"]
        print(
            f"[same_batch] batch {b + 1}/{a.batches}: gradient cosine {g['cosine']:.6f} "
            f"(tensor min {g['tensor_cosine_min']:.4f}), update cosine "
            f"{result['update']['cosine']:.6f}, {result['constant_groups']} constant groups",
            flush=True,
        )
    out = {
        "preset": a.preset,
        "model": str(a.model),
        "seed": a.seed,
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "batches": batches,
    }
    write_result(a.out, a.preset, out)
    (a.out.parent / "table.md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()

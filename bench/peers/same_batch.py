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
import sys
import time
from collections import defaultdict, deque
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


def ours_step(plan: Plan, model: str, batch: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """Our trainer's gradient (before clipping) and parameter update on ``batch``."""

    from api.protocol import ScoredGroup
    from trainer.batch import flatten_groups
    from trainer.grpo_step import StepContext, accumulate
    from trainer.model import Reference, load_model
    from trainer.optim import build_optimizer, build_scheduler, clip_and_step

    cfg = plan.grpo.model_copy(
        update={"model_name": model, "save_path": str(work), "tensorboard": False}
    )
    lm = load_model(cfg)
    groups = []
    for g, prompt in enumerate(batch):
        p = prompt["prompt"]
        seqs = [
            {
                "tokens": p + c,
                "mask": [0] * len(p) + [1] * len(c),
                "logprobs": [0.0] * (len(p) + len(c)),
                "score": s,
            }
            for c, s in zip(prompt["completions"], prompt["scores"], strict=True)
        ]
        groups.append(
            ScoredGroup.model_validate(
                {"group_id": f"g{g}", "env": "shop_r1", "policy_version": 0, "sequences": seqs}
            )
        )
    items, dropped = flatten_groups(groups, cfg.max_seq_len)
    if dropped or not all(i.trainable for i in items):
        raise ValueError(f"{dropped} sequences malformed or over max_seq_len {cfg.max_seq_len}")
    for item in items:  # the trainer's own logprobs stand in: ratio 1, on-policy as TRL
        item.logprobs_missing = True
    named = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in named.items()}
    opt = build_optimizer(lm.model, cfg)
    ref = Reference(lm) if cfg.kl_beta > 0 else None
    ctx = StepContext(lm, ref, opt, build_scheduler(opt, cfg), cfg)
    t0 = time.perf_counter()
    stats = accumulate(ctx, items)
    grads = {n: p.grad.detach().clone() for n, p in named.items()}
    grad_norm = clip_and_step(lm.model, opt, ctx.scheduler, cfg.max_grad_norm)
    seconds = time.perf_counter() - t0
    update = {n: p.detach() - before[n] for n, p in named.items()}
    return {
        "grads": grads,
        "update": update,
        "lr": opt.param_groups[0]["lr"],
        "seconds": seconds,
        "precision": str(lm.compute_dtype),
        "stats": {k: stats[k] for k in ("loss", "score_mean", "clip_fraction", "tokens")}
        | {"grad_norm": grad_norm},
    }


def trl_step(
    plan: Plan, model: str, batch: list[dict[str, Any]], work: Path, bf16: bool, micro: int
) -> dict[str, Any]:
    """TRL's gradient (at its optimizer step) and parameter update on ``batch``: one
    ``GRPOTrainer.train`` step whose generation returns ``batch``'s completions."""
    import torch

    from bench.peers.settings import ensure_trl, trl_args

    sys.path.insert(0, str(ensure_trl()))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.peers.data import ShopR1Reward, trl_rows

    env = plan.env
    tok = AutoTokenizer.from_pretrained(model)
    data = trl_rows([p["row"] for p in batch], tok, env.max_prompt_tokens, env.latest_only)
    tok.padding_side = "left"
    kw = trl_args(plan, work, bf16, micro_batch=micro)
    kw |= {"max_steps": 1, "save_strategy": "no", "seed": plan.grpo.seed}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=ShopR1Reward(env.reward_config()),
        args=GRPOConfig(**kw),
        train_dataset=Dataset.from_list(data),
        processing_class=tok,
    )
    queued: dict[tuple[int, ...], deque[list[int]]] = defaultdict(deque)
    for p in batch:
        queued[tuple(p["prompt"])].extend(p["completions"])

    def replay(prompt_ids: list[list[int]], *_: Any, **__: Any) -> tuple[list, None]:
        return [queued[tuple(ids)].popleft() for ids in prompt_ids], None

    trainer._generate_single_turn = replay
    named = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in named.items()}
    got: dict[str, Any] = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, *_: Any, **kwargs: Any) -> None:
            got["grads"] = {n: p.grad.detach().clone() for n, p in named.items()}
            got["lr"] = kwargs["optimizer"].param_groups[0]["lr"]

        def on_log(self, _a: Any, _s: Any, _c: Any, logs: Any = None, **__: Any) -> None:
            got.setdefault("logs", {}).update(logs or {})

    trainer.add_callback(Capture())
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    if any(queued.values()):
        raise RuntimeError("TRL did not ask for every completion of the batch")
    logs = got.get("logs", {})
    return {
        "grads": got["grads"],
        "update": {n: p.detach() - before[n] for n, p in named.items()},
        "lr": got["lr"],
        "seconds": seconds,
        "precision": "bf16 autocast" if bf16 else str(torch.float32),
        "stats": {k: logs.get(k) for k in ("loss", "reward", "grad_norm", "frac_reward_zero_std")},
    }


SIDES = {"ours": ours_step, "trl": trl_step}


def run_side(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One side on one batch, in its own process (``--child``): its gradient and update go to
    ``<work>/tensors.safetensors`` (``grad/NAME``, ``update/NAME``), the rest is returned."""
    from safetensors.torch import save_file

    from bench.peers.settings import resolve

    plan = resolve(list(spec["argv"]), 1)
    batch = json.loads(Path(spec["batch"]).read_text())
    work = Path(spec["work"])
    if spec["side"] == "ours":
        got = ours_step(plan, spec["model"], batch, work)
    else:
        got = trl_step(plan, spec["model"], batch, work, spec["bf16"], spec["micro"])
    tensors = {f"grad/{n}": t.contiguous() for n, t in got.pop("grads").items()}
    tensors |= {f"update/{n}": t.contiguous() for n, t in got.pop("update").items()}
    work.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(work / "tensors.safetensors"))
    return got


def _load(work: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    flat = load_file(str(work / "tensors.safetensors"))
    out: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "update": {}}
    for key, t in flat.items():
        kind, name = key.split("/", 1)
        out["grads" if kind == "grad" else "update"][name] = t
    return out


def one_batch(
    plan: Plan, model: str, batch: list[dict[str, Any]], work: Path, micro: int
) -> dict[str, Any]:
    """Both sides on ``batch``, each in a fresh process (so neither inherits the other's
    memory), and what they did compared."""
    from bench.common import run_child
    from bench.peers.settings import compute_precision

    bf16, why = compute_precision(plan)
    work.mkdir(parents=True, exist_ok=True)
    (work / "batch.json").write_text(json.dumps(batch))
    spec = {"argv": plan.run_all_argv, "model": model, "batch": str(work / "batch.json")}
    spec |= {"bf16": bf16, "micro": micro}
    side = {
        name: run_child("bench.peers.same_batch", spec | {"side": name, "work": str(work / name)})
        for name in SIDES
    }
    ours, trl = side["ours"], side["trl"]
    ours |= _load(work / "ours")
    trl |= _load(work / "trl")
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
    ap.add_argument("--model", help="the start checkpoint (an SFT model folder; required)")
    ap.add_argument("--preset", default="cpu-smol", help="whose settings both sides take")
    ap.add_argument("--batches", type=int, default=3, help="batches, each from the start model")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (and the run's)")
    ap.add_argument(
        "--trl-micro-batch", type=int, default=8, help="completions per TRL forward/backward"
    )
    ap.add_argument("--work-dir", type=Path, default=Path("runs/same_batch"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "peer_same_batch" / "result.json",
        help="the result (JSON, under the preset's key); the table goes beside it (table.md)",
    )
    a = ap.parse_args()
    if a.child:
        from bench.common import write_child_result

        write_child_result(a.child_result, run_side(json.loads(a.child)))
        return
    if not a.model:
        ap.error("--model is required")

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

"""One optimizer step of either trainer on a given batch, for ``bench/peers/same_batch.py``:
ours (``trainer.grpo_step``) or TRL's ``GRPOTrainer`` (trl==1.16.0), each run in a fresh
process so that neither inherits the other's memory (two SmolLM2 trainers' leftovers in one
process went past 23.5 GiB):

    python -m bench.peers.one_step --child SPEC --child-result FILE    (run_child writes both)

SPEC (JSON): ``side`` (``ours`` or ``trl``), ``argv`` (the run_all arguments whose resolved
settings both sides take, bench/peers/settings.py), ``model``, ``batch`` (a JSON file: per
prompt its ``row``, ``prompt`` ids, ``completions`` ids and ``scores``), ``work`` (a folder),
``bf16`` and ``micro`` (TRL's precision and completions per forward). The step's gradient and
parameter update go to ``<work>/tensors.safetensors`` (``grad/NAME``, ``update/NAME``; read
back with ``load_tensors``); FILE gets its learning rate, seconds, precision and statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from bench.peers.settings import Plan


def ours_step(plan: Plan, model: str, batch: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """Our trainer's gradient (before clipping) and parameter update on ``batch``, each prompt's
    completions made into the group the env would push (``env_server.rollout.build_group``)."""
    from api.protocol import ScoredGroup
    from env_server.inference import Completion, CompletionBatch
    from env_server.rollout import build_group
    from trainer.batch import flatten_groups
    from trainer.grpo_step import StepContext, accumulate
    from trainer.model import Reference, load_model
    from trainer.optim import build_optimizer, build_scheduler, clip_and_step

    cfg = plan.grpo.model_copy(
        update={"model_name": model, "save_path": str(work), "tensorboard": False}
    )
    lm = load_model(cfg)
    tok, reward = lm.tokenizer, plan.env.reward_config()
    groups = []
    for prompt in batch:
        comps = [
            Completion(tok.decode(c, skip_special_tokens=True), c, [0.0] * len(c), None)
            for c in prompt["completions"]
        ]
        group = build_group(
            prompt["row"], CompletionBatch(prompt["prompt"], comps, 0), tok, reward, 0
        )
        groups.append(ScoredGroup.model_validate(group))
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


SIDES = ("ours", "trl")


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


def load_tensors(work: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    flat = load_file(str(work / "tensors.safetensors"))
    out: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "update": {}}
    for key, t in flat.items():
        kind, name = key.split("/", 1)
        out["grads" if kind == "grad" else "update"][name] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.peers.one_step",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--child", required=True, help="the step's SPEC (JSON, above)")
    ap.add_argument("--child-result", type=Path, required=True, help="where the result goes")
    a = ap.parse_args()
    from bench.common import write_child_result

    write_child_result(a.child_result, run_side(json.loads(a.child)))


if __name__ == "__main__":
    main()

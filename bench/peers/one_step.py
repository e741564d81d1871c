"""Optimizer steps of either trainer on given batches, one step per batch, for
``bench/peers/same_batch.py``: ours (``trainer.grpo_step``) or TRL's ``GRPOTrainer``
(trl==1.16.0), each run in a fresh process so that neither inherits the other's memory (two
SmolLM2 trainers' leftovers in one process went past 23.5 GiB):

    python -m bench.peers.one_step --child SPEC --child-result FILE    (run_child writes both)

SPEC (JSON): ``side`` (``ours`` or ``trl``), ``argv`` (the run_all arguments whose resolved
settings both sides take, bench/peers/settings.py), ``model``, ``batches`` (a JSON file: a
list of batches, each a list with per prompt its ``row``, ``prompt`` ids, ``completions`` ids
and ``scores``), ``work`` (a folder), ``bf16`` and ``micro`` (TRL's precision and completions
per forward). Step k's gradient and the parameter update since the start go to
``<work>/step{k}.safetensors`` (``grad/NAME``, ``update/NAME``; read back by
``bench.peers.compare_updates.compare_steps``); FILE and ``<work>/result.json`` get each
step's learning rate, seconds and statistics, and the precision.
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


def _save_step(work: Path, step: int, grads: Mapping, update: Mapping) -> None:
    """Step ``step``'s gradient and the update since the start, as ``<work>/step{step}.safetensors``
    (``grad/NAME``, ``update/NAME``; read by ``compare_updates.compare_steps``)."""
    from safetensors.torch import save_file

    tensors = {f"grad/{n}": t.contiguous() for n, t in grads.items()}
    tensors |= {f"update/{n}": t.contiguous() for n, t in update.items()}
    work.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(work / f"step{step}.safetensors"))


def ours_steps(
    plan: Plan, model: str, batches: list[list[dict[str, Any]]], work: Path
) -> dict[str, Any]:
    """Our trainer, one optimizer step per batch in turn: each step's gradient (before
    clipping) and the update since the start go to ``work``; each prompt's completions are
    made into the group the env would push (``env_server.rollout.build_group``)."""
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
    named = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in named.items()}
    opt = build_optimizer(lm.model, cfg)
    ref = Reference(lm) if cfg.kl_beta > 0 else None
    ctx = StepContext(lm, ref, opt, build_scheduler(opt, cfg), cfg)
    steps = []
    for step, batch in enumerate(batches):
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
        lr = opt.param_groups[0]["lr"]
        t0 = time.perf_counter()
        stats = accumulate(ctx, items)
        grads = {n: p.grad.detach().clone() for n, p in named.items()}
        grad_norm = clip_and_step(lm.model, opt, ctx.scheduler, cfg.max_grad_norm)
        seconds = time.perf_counter() - t0
        _save_step(work, step, grads, {n: p.detach() - start[n] for n, p in named.items()})
        del grads
        steps.append(
            {
                "lr": lr,
                "seconds": seconds,
                "stats": {k: stats[k] for k in ("loss", "score_mean", "clip_fraction", "tokens")}
                | {"grad_norm": grad_norm},
            }
        )
    return {"precision": str(lm.compute_dtype), "steps": steps}


def trl_steps(
    plan: Plan,
    model: str,
    batches: list[list[dict[str, Any]]],
    work: Path,
    bf16: bool,
    micro: int,
) -> dict[str, Any]:
    """TRL's ``GRPOTrainer.train`` for one step per batch, its generation returning the
    batches' completions: each step's gradient (at its optimizer step) and the update since
    the start go to ``work``."""
    import torch

    from bench.peers.settings import trl_args
    from bench.peers.trl_install import ensure_trl

    sys.path.insert(0, str(ensure_trl()))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.peers.data import ShopR1Reward, trl_rows

    env = plan.env
    tok = AutoTokenizer.from_pretrained(model)
    rows = [p["row"] for batch in batches for p in batch]  # in order: trl_args does not shuffle
    data = trl_rows(rows, tok, env.max_prompt_tokens, env.latest_only)
    tok.padding_side = "left"
    kw = trl_args(plan, work, bf16, micro_batch=micro)
    kw |= {"max_steps": len(batches), "save_strategy": "no", "seed": plan.grpo.seed}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=ShopR1Reward(env.reward_config()),
        args=GRPOConfig(**kw),
        train_dataset=Dataset.from_list(data),
        processing_class=tok,
    )
    queued: dict[tuple[int, ...], deque[list[int]]] = defaultdict(deque)
    for batch in batches:
        for p in batch:
            queued[tuple(p["prompt"])].extend(p["completions"])

    def replay(prompt_ids: list[list[int]], *_: Any, **__: Any) -> tuple[list, None]:
        return [queued[tuple(ids)].popleft() for ids in prompt_ids], None

    trainer._generate_single_turn = replay
    named = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in named.items()}
    steps: list[dict[str, Any]] = []
    grads: dict[str, torch.Tensor] = {}
    clock = [time.perf_counter()]

    class Capture(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            clock[0] = time.perf_counter()

        def on_pre_optimizer_step(self, *_: Any, **kwargs: Any) -> None:
            grads.update({n: p.grad.detach().clone() for n, p in named.items()})
            steps.append({"lr": kwargs["optimizer"].param_groups[0]["lr"]})

        def on_step_end(self, *_: Any, **__: Any) -> None:
            update = {n: p.detach() - start[n] for n, p in named.items()}
            _save_step(work, len(steps) - 1, grads, update)
            grads.clear()
            now = time.perf_counter()
            steps[-1]["seconds"], clock[0] = now - clock[0], now

        def on_log(self, _a: Any, _s: Any, _c: Any, logs: Any = None, **__: Any) -> None:
            keys = ("loss", "reward", "grad_norm", "frac_reward_zero_std")
            if steps and logs and "loss" in logs:
                steps[-1]["stats"] = {k: logs.get(k) for k in keys}

    trainer.add_callback(Capture())
    trainer.train()
    if any(queued.values()):
        raise RuntimeError("TRL did not ask for every completion of the batches")
    if len(steps) != len(batches):
        raise RuntimeError(f"TRL took {len(steps)} optimizer steps for {len(batches)} batches")
    return {"precision": "bf16 autocast" if bf16 else str(torch.float32), "steps": steps}


SIDES = ("ours", "trl")


def run_side(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One side on the batches, one optimizer step each, in its own process (``--child``):
    each step's gradient and the update since the start go to ``<work>/step{k}.safetensors``,
    the rest is returned."""
    from bench.peers.settings import resolve

    plan = resolve(list(spec["argv"]), 1)
    batches = json.loads(Path(spec["batches"]).read_text())
    work = Path(spec["work"])
    if spec["side"] == "ours":
        got = ours_steps(plan, spec["model"], batches, work)
    else:
        got = trl_steps(plan, spec["model"], batches, work, spec["bf16"], spec["micro"])
    (work / "result.json").write_text(json.dumps(got))  # all steps saved: --reuse-work-dir
    return got


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

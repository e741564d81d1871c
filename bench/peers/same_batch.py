"""Same batches, both trainers: the gradients and the updates of this stack's GRPO steps and
of TRL's GRPOTrainer (trl==1.16.0) on identical batches (issue 46 point 5: after the same
samples TRL had learned more in every seed; is that in the update rule, or in what each side
sampled?).

    flock /tmp/heavy.lock .venv/bin/python -m bench.peers.same_batch --model SFT_DIR \\
        --preset cpu-smol --batches 3              # three one-step runs
    ... --batches 1 --steps 4                      # one run of four steps

Each batch holds the preset's ``prompts_per_step`` train rows (the env's order, continuing
across batches) with ``group_size`` completions each, sampled once by transformers
``generate`` from ``--model`` at the preset's temperature, top-p and completion budget
(seeded per batch), and scored by the env's reward (``bench/peers/data.py``). A run takes
``--steps`` batches and, from the same start weights, one optimizer step on each in turn:

- ours: ``trainer.grpo_step.accumulate`` on those sequences with the preset's resolved
  ``GrpoConfig`` (prefix-tree packing, self-certainty off as in the peer bench), every group
  kept (TRL trains constant groups at advantage 0; ours' env would drop them), the inference
  logprobs marked missing so the trainer's own stand in (ratio 1, as TRL's on-policy ratio
  without vLLM); then ``clip_and_step``.
- TRL: ``GRPOTrainer.train`` for ``--steps`` steps on the same prompts in the same order
  (``trl_args``: dr_grpo, group scaling, the same AdamW, clip and schedule, no shuffling),
  its generation replaced by the same completions (``_generate_single_turn`` returns them;
  TRL decodes, rewards, computes the advantages, the loss and the optimizer step itself). Its
  gradient is read when the optimizer is about to step (after TRL's clip).

Each side's run is a fresh process (``bench/peers/one_step.py``). After the first step the
batches are off-policy for both sides alike (sampled from the start model, trained at ratio
1), which is what a comparison of the update rules needs: the same data, step by step.

Compared per step (``compare_steps``): the cosine of the two gradients (each on its own side's
weights) over the whole model and per tensor, their norms before clipping, the rewards each
side computed, the cosine of the two updates since the start, and AdamW replayed on each
side's gradients (``adamw_updates``, ``PREDICTIONS``): on ours' as clipped it should match the
measured update cosine; on ours' before clipping, or rescaled to TRL's lengths, it says how
much of the difference is our clipping or the gradients' lengths rather than their
directions. Both sides compute in the precision our trainer picks on this CPU
(``--precision auto``). Written: ``--out`` (JSON) and ``table.md`` beside it. The loss
normalisers differ by a constant (ours: the step's trained tokens; TRL ``dr_grpo``: sequences
x max_completion_length), as do the advantage scales (ours: population std; TRL: sample std),
so the gradients may differ in length, not in direction; at the same ``max_grad_norm`` the
longer one is clipped more often. ``--trl-normaliser`` gives ours TRL's normaliser
(``loss_aggregation: constant`` over the completion budget): then only the std's factor
sqrt(G / (G - 1)) is left between the lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import RESULTS, machine, write_result
from bench.peers.compare_updates import compare_steps
from bench.peers.settings import add_trl_normaliser

if TYPE_CHECKING:
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


def side_settings(plan: Plan, side: str, bf16: bool, micro: int) -> dict[str, Any]:
    """What one side's steps depend on besides the batches (paths left out): ours its
    resolved trainer config, TRL its ``GRPOConfig`` keywords; both the env's config (the
    reward)."""
    from bench.peers.settings import trl_args

    env = plan.env.model_dump(mode="json", exclude={"metrics_path"})
    if side == "ours":
        return {"env": env, "grpo": plan.grpo.model_dump(mode="json", exclude={"save_path"})}
    args = trl_args(plan, Path("."), bf16, micro)
    return {"env": env, "trl": {k: v for k, v in args.items() if k != "output_dir"}}


def same_settings(recorded: Path, settings: dict[str, Any]) -> bool:
    """Whether a side's finished run in ``recorded``'s folder ran with ``settings``: its
    ``settings.json`` says so (none recorded: not known, so not reused)."""
    if not recorded.exists():
        why = "no settings recorded"
    elif json.loads(recorded.read_text()) != json.loads(json.dumps(settings)):
        why = "run with other settings"
    else:
        return True
    print(f"[same_batch] {recorded.parent}: {why}: run again", flush=True)
    return False


def one_run(
    plan: Plan,
    model: str,
    batches: list[list[dict[str, Any]]],
    work: Path,
    micro: int,
    reuse: bool = False,
) -> dict[str, Any]:
    """Both sides from the same start, one optimizer step per batch in turn, each side in a
    fresh process (so neither inherits the other's memory), and what they did compared step
    by step (``compare_steps``). ``reuse``: a side whose run on these batches finished in
    ``work`` before (its ``result.json``) with the same settings (``side_settings``, in its
    ``settings.json``) is not run again."""
    from bench.common import run_child
    from bench.peers.one_step import SIDES
    from bench.peers.settings import compute_precision

    bf16, why = compute_precision(plan)
    work.mkdir(parents=True, exist_ok=True)
    (work / "batches.json").write_text(json.dumps(batches))
    spec = {"argv": plan.run_all_argv, "model": model, "batches": str(work / "batches.json")}
    spec |= {"bf16": bf16, "micro": micro}
    # glibc keeps freed activations of a few MB in its heaps, fragmented: TRL's SmolLM2 run
    # held ~12 GB after its first step and was OOM-killed at 23.9 GB in its second (23.5 GiB
    # box). The sides map allocations from 1 MiB up instead, given back when freed.
    malloc = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(1 << 20))}
    side = {}
    for name in SIDES:
        done, recorded = work / name / "result.json", work / name / "settings.json"
        settings = side_settings(plan, name, bf16, micro) | {"model": model}
        if reuse and done.exists() and same_settings(recorded, settings):
            print(f"[same_batch] reusing {done}", flush=True)
            side[name] = json.loads(done.read_text())
        else:
            recorded.parent.mkdir(parents=True, exist_ok=True)
            recorded.write_text(json.dumps(settings, indent=1) + "\n")
            child = spec | {"side": name, "work": str(work / name)}
            side[name] = run_child("bench.peers.one_step", child, env=malloc)
    ours, trl = side["ours"], side["trl"]
    steps = []
    for batch, o, t, compared in zip(
        batches, ours["steps"], trl["steps"], compare_steps(work, ours, trl, plan), strict=True
    ):
        scores = [s for p in batch for s in p["scores"]]
        steps.append(
            {
                "prompts": len(batch),
                "completions": len(scores),
                "constant_groups": sum(len(set(p["scores"])) == 1 for p in batch),
                "reward_mean": statistics.fmean(scores),
                "completion_tokens_mean": statistics.fmean(
                    len(c) for p in batch for c in p["completions"]
                ),
                "lr": {"ours": o["lr"], "trl": t["lr"]},
                "seconds": {"ours": o["seconds"], "trl": t["seconds"]},
                "ours": o["stats"],
                "trl": t["stats"],
            }
            | compared
        )
    precision = {"ours": ours["precision"], "trl": trl["precision"], "why": why}
    return {"precision": precision, "steps": steps}


def markdown(result: Mapping[str, Any]) -> str:
    first = result["runs"][0]["precision"]
    lines = [
        f"{result['preset']}, model `{result['model']}`, {result['machine'].get('cpu')}, "
        f"{first['ours']} (ours) / {first['trl']} (TRL); each run from the start model, one "
        "optimizer step per batch",
        "",
        "| run | step | constant groups | reward mean | gradient cosine (tensor min / median) | "
        "grad norm ours / TRL (before clipping) | update since the start: cosine (tensor min) | "
        "AdamW replayed: predicted / ours unclipped / same-length gradients |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, run in enumerate(result["runs"]):
        for k, b in enumerate(run["steps"]):
            g, u, p = b["gradient"], b["update"], b["adamw_replayed"]
            lines.append(
                f"| {r} | {k + 1} | {b['constant_groups']} of {b['prompts']} | "
                f"{b['reward_mean']:.3f} | {g['cosine']:.6f} ({g['tensor_cosine_min']:.4f} / "
                f"{g['tensor_cosine_median']:.6f}) | {b['ours']['grad_norm']:.4g} / "
                f"{b['trl']['grad_norm']:.4g} | {u['cosine']:.6f} ({u['tensor_cosine_min']:.4f}) | "
                f"{p['predicted']:.6f} / {p['unclipped']:.6f} / {p['same_length']:.6f} |"
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
    ap.add_argument("--batches", type=int, default=3, help="runs, each from the start model")
    ap.add_argument(
        "--steps", type=int, default=1, help="optimizer steps a run, each on a batch of its own"
    )
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (and the run's)")
    ap.add_argument(
        "--trl-micro-batch", type=int, default=8, help="completions per TRL forward/backward"
    )
    add_trl_normaliser(ap)
    ap.add_argument("--work-dir", type=Path, default=Path("runs/same_batch"))
    ap.add_argument(
        "--reuse-work-dir",
        action="store_true",
        help="reuse what an earlier run with the same --work-dir and settings left: each run's "
        "sampled batches and each side's finished steps",
    )
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
    from bench.peers.settings import resolve_plan

    work = a.work_dir.resolve()
    plan = resolve_plan(
        1,
        a.trl_normaliser,
        preset=a.preset,
        run_dir=work / "plan",
        steps=None,
        keep=1,
        model=str(a.model),
        seed=a.seed,
    )
    env = plan.env
    n = plan.prompts_per_step
    rows = rows_in_env_order(env.data_dir, env.num_sessions, env.seed, n * a.batches * a.steps)
    tok = AutoTokenizer.from_pretrained(a.model)
    sampler = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    runs = []
    for r in range(a.batches):
        t0 = time.perf_counter()
        saved = work / f"run{r}" / "batches.json"
        if a.reuse_work_dir and saved.exists():
            batches = json.loads(saved.read_text())
            if len(batches) != a.steps:
                raise SystemExit(f"{saved} holds {len(batches)} batches, not --steps {a.steps}")
            print(f"[same_batch] reusing {saved}", flush=True)
        else:
            batches = [  # batch k: rows and seed of its own
                sample_batch(sampler, tok, rows[k * n : (k + 1) * n], plan, a.seed * 100 + k)
                for k in range(r * a.steps, (r + 1) * a.steps)
            ]
        sampled = time.perf_counter() - t0
        run = one_run(
            plan, str(a.model), batches, work / f"run{r}", a.trl_micro_batch, a.reuse_work_dir
        )
        run["sampling_seconds"] = sampled
        runs.append(run)
        for k, step in enumerate(run["steps"]):
            print(
                f"[same_batch] run {r + 1}/{a.batches} step {k + 1}/{a.steps}: gradient cosine "
                f"{step['gradient']['cosine']:.6f}, update cosine {step['update']['cosine']:.6f} "
                f"(AdamW replayed {step['adamw_replayed']['predicted']:.6f}), "
                f"{step['constant_groups']} constant groups",
                flush=True,
            )
    out = {
        "preset": a.preset,
        "model": str(a.model),
        "seed": a.seed,
        "steps": a.steps,
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "runs": runs,
    }
    write_result(a.out, a.preset, out)
    (a.out.parent / "table.md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()

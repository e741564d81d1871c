"""Packed prefix trees vs padded rows: GRPO step time, tokens computed and peak memory, and
SFT tokens per second, measured in one run.

    flock /tmp/heavy.lock .venv/bin/python -m bench.trainer.packing --preset cpu-smol \\
        --group-sizes 4,8,16 [--rounds 2] [--sft]

Each point (packing x group size) runs in a fresh process (its peak memory is its own): the
preset's trainer settings, a warm-up step, then ``--steps`` measured ``grpo_step`` calls
(median) on ``--groups`` groups of real Shop-R1 prompts (validation rows, chat-templated,
fitted to ``--prompt-tokens`` as the env fits them) with random completions of
``--completion-tokens``. Points are interleaved (round r runs each once; medians over rounds).
``--orders fused,two_pass`` times the packed step's two orders on one micro-batch (keys
``.../prefix_tree/<order>/G<g>``); ``--sft`` adds one SFT step of the preset's batch, padded vs
packed. ``--device cuda``: on the GPU (steps timed between ``torch.cuda.synchronize`` calls,
the CUDA allocator's peak; keys ``<preset>/cuda/...``). A machine without the dataset reads
the prompts and examples from ``--inputs FILE``, written by ``--write-inputs FILE`` where the
dataset is (bench/cuda_rows.sh). Results: docs/results/trainer_packing.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import RESULTS, machine, parse_list, run_child, write_child_result, write_result

if TYPE_CHECKING:
    from api.protocol import ScoredGroup

PACKINGS = ("padded", "prefix_tree")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _preset(name: str) -> dict[str, Any]:
    from settings.layers import read_recipe
    from settings.paths import PRESETS_DIR

    return read_recipe(PRESETS_DIR / f"{name}.yaml")


def real_prompts(tokenizer: Any, n: int, max_tokens: int, seed: int) -> list[list[int]]:
    from env_server.rollout import prompt_ids
    from settings.paths import DATA_DIR
    from trainer.sft_data import load_or_build_dataset

    rows = list(load_or_build_dataset(DATA_DIR, None)["validation"])
    rng = random.Random(seed)
    return [prompt_ids(r, tokenizer, max_tokens, False) for r in rng.sample(rows, n)]


def inputs_of(spec: dict[str, Any], tokenizer: Any, cfg: Any) -> Any:
    """The step's real inputs: GRPO prompts or SFT examples, from ``--inputs`` when given."""
    from trainer.sft_data import SftExample

    kind, seed = spec["kind"], spec["seed"]
    if spec.get("inputs"):
        stored = json.loads(Path(spec["inputs"]).read_text())[f"{kind}/{seed}"]
        return stored if kind == "grpo" else [SftExample(**e) for e in stored]
    if kind == "grpo":
        return real_prompts(tokenizer, spec["groups"], spec["prompt_tokens"], seed)
    from settings.paths import DATA_DIR
    from trainer.sft_data import encode_split, load_or_build_dataset

    rows = list(load_or_build_dataset(DATA_DIR, None)["train"])
    rng = random.Random(seed)
    rows = rng.sample(rows, cfg.batch_size * 2)
    return encode_split(rows, tokenizer, cfg.max_seq_len, cfg.latest_only)


def groups_of(
    prompts: list[list[int]], size: int, lo: int, hi: int, vocab: int, seed: int
) -> list[ScoredGroup]:
    from api.protocol import ScoredGroup

    rng = random.Random(seed)
    out = []
    for g, prompt in enumerate(prompts):
        seqs = []
        for _ in range(size):
            comp = [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))]
            seqs.append(
                {
                    "tokens": prompt + comp,
                    "mask": [0] * len(prompt) + [1] * len(comp),
                    "logprobs": [0.0] * len(prompt) + [-rng.uniform(0.2, 4) for _ in comp],
                    "score": rng.random(),
                    "spans": {
                        "rationale": [0] * len(prompt)
                        + [1] * (len(comp) // 2)
                        + [0] * (len(comp) - len(comp) // 2)
                    },
                }
            )
        group = {"group_id": f"g{g}", "env": "bench", "policy_version": 0, "sequences": seqs}
        out.append(ScoredGroup.model_validate(group))
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One point in this process: load, warm up, measure one step."""
    import torch

    from trainer.batch import flatten_groups
    from trainer.config import GrpoConfig, SftConfig
    from trainer.grpo_step import StepContext, grpo_step
    from trainer.model import Reference, autocast, load_model
    from trainer.optim import build_optimizer, build_scheduler, clip_and_step

    cuda = spec.get("device") == "cuda"

    def timed(fn: Any, *args: Any) -> tuple[float, Any]:
        """The median wall time of ``--steps`` calls, and the last call's result."""
        times = []
        for _ in range(spec.get("steps", 1)):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    def memory() -> dict[str, Any]:
        """Peak memory of the measured steps: RSS, and on CUDA the allocator's peak."""
        mem: dict[str, Any] = {"rss_loaded_mib": rss_loaded, "rss_peak_mib": _rss_mib()}
        if cuda:
            mem |= {
                "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                "gpu": torch.cuda.get_device_name(),
            }
        return mem

    sec = spec["section"]
    kind = spec["kind"]
    cls = SftConfig if kind == "sft" else GrpoConfig
    with tempfile.TemporaryDirectory() as tmp:
        keep = {
            k: v
            for k, v in sec.items()
            if k in cls.model_fields and k not in ("training_steps", "save_every", "eval_every")
        }
        cfg = cls(
            **{
                **keep,
                "model_name": spec["model"],
                "save_path": tmp,
                "tensorboard": False,
                "packing": spec["packing"],
                "device": spec.get("device", "cpu"),
            }
        )
        lm = load_model(cfg)
        opt = build_optimizer(lm.model, cfg)
        sched = build_scheduler(opt, cfg)
        vocab = int(lm.model.get_output_embeddings().weight.shape[0])
        rss_loaded = _rss_mib()
        if kind == "grpo":
            ref = Reference(lm) if cfg.kl_beta > 0 else None
            ctx = StepContext(lm, ref, opt, sched, cfg)
            lo, hi = spec["completion"]
            prompts = inputs_of(spec, lm.tokenizer, cfg)
            warm = groups_of([p[:64] for p in prompts[:1]], 2, lo, hi, vocab, seed=99)
            grpo_step(ctx, flatten_groups(warm, cfg.max_seq_len)[0])
            rss_warm = _rss_mib()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            items, _ = flatten_groups(
                groups_of(prompts, spec["group_size"], lo, hi, vocab, spec["seed"]), cfg.max_seq_len
            )
            if spec.get("order") == "two_pass":  # the scoring pass runs even on one micro-batch
                import trainer.grpo_step

                trainer.grpo_step.fused = lambda ctx, mine: False
            step_s, stats = timed(grpo_step, ctx, items)
            return {
                "step_s": step_s,
                "forward_tokens": stats["forward_tokens"],
                "sequence_tokens": stats["sequence_tokens"],
                "micro_batches": stats["micro_batches"],
                "order": spec.get("order") or "auto",
                "sequences": len(items),
                "trained_tokens": stats["tokens"],
                "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
                "loss": stats["loss"],
                **memory(),
                "rss_step_mib": _rss_mib() - max(rss_loaded, rss_warm),
                "precision": "bf16" if lm.compute_dtype == torch.bfloat16 else "fp32",
                "threads": torch.get_num_threads(),
            }
        from trainer.sft import _nll

        examples = inputs_of(spec, lm.tokenizer, cfg)
        batch = examples[: cfg.batch_size]

        def step(exs: list) -> None:
            n_target = float(sum(sum(e.loss_mask[1:]) for e in exs))
            for i in range(0, len(exs), cfg.micro_batch_size):
                with autocast(lm.device, lm.compute_dtype):
                    nll = _nll(lm, exs[i : i + cfg.micro_batch_size], cfg)
                (nll / n_target).backward()
            clip_and_step(lm.model, opt, sched, cfg.max_grad_norm)

        step(examples[cfg.batch_size : cfg.batch_size + cfg.micro_batch_size])  # warm-up
        rss_warm = _rss_mib()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step_s, _ = timed(step, batch)
        targets = sum(sum(e.loss_mask) for e in batch)
        total = sum(len(e.tokens) for e in batch)
        return {
            "step_s": step_s,
            "examples": len(batch),
            "micro_batch_size": cfg.micro_batch_size,
            "target_tokens_per_s": targets / step_s,
            "tokens_per_s": total / step_s,
            "sequence_tokens": total,
            **memory(),
            "rss_step_mib": _rss_mib() - max(rss_loaded, rss_warm),
            "precision": "bf16" if lm.compute_dtype == torch.bfloat16 else "fp32",
            "threads": torch.get_num_threads(),
        }


def write_inputs(path: Path, specs: list[dict[str, Any]], rounds: int) -> None:
    """Every round's prompts and SFT examples of ``specs``, for a machine without the data."""
    from dataclasses import asdict

    from transformers import AutoTokenizer

    from trainer.config import SftConfig

    out: dict[str, Any] = {}
    tokenizers: dict[str, Any] = {}
    for spec in specs:
        for seed in range(rounds):
            key = f"{spec['kind']}/{seed}"
            if key in out:
                continue
            if spec["model"] not in tokenizers:
                tokenizers[spec["model"]] = AutoTokenizer.from_pretrained(spec["model"])
            fields = {k: v for k, v in spec["section"].items() if k in SftConfig.model_fields}
            cfg = SftConfig(**{**fields, "model_name": spec["model"]})
            got = inputs_of({**spec, "seed": seed, "inputs": None}, tokenizers[spec["model"]], cfg)
            out[key] = got if spec["kind"] == "grpo" else [asdict(e) for e in got]
    path.write_text(json.dumps(out))
    print(f"{len(out)} inputs (kind/round) written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.trainer.packing",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--preset", default="cpu-smol", help="the preset whose trainer settings run")
    ap.add_argument("--group-sizes", default="4,8,16")
    ap.add_argument("--groups", type=int, default=2, help="groups per step")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="default: the preset env's max_prompt_tokens",
    )
    ap.add_argument("--completion-tokens", default="64-96", help="range of completion lengths")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sft", action="store_true", help="also SFT rows (the preset's SFT batch)")
    ap.add_argument("--model", default=None, help="default: the preset's launch.base_model")
    ap.add_argument(
        "--padded-micro-batch-tokens",
        type=int,
        default=2048,
        help="micro-batch tokens of the padded rows (2048: what cpu-smol ran before packing; "
        "the preset's 8192 puts the padded G=8 step's peak near 20 GB on SmolLM2)",
    )
    ap.add_argument(
        "--orders",
        default=None,
        help="fused,two_pass: the packed step's two orders on one micro-batch, instead of "
        "padded vs packed",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=1, help="measured steps per point (median)")
    ap.add_argument("--inputs", type=Path, help="read prompts/examples from this file")
    ap.add_argument("--write-inputs", type=Path, help="write them there, and measure nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "trainer_packing.json")
    a = ap.parse_args()
    if a.child:
        write_child_result(a.child_result, child(json.loads(a.child)))
        return
    preset = _preset(a.preset)
    model = a.model or preset["launch"]["base_model"]
    prompt_tokens = a.prompt_tokens or int(preset["env"]["max_prompt_tokens"])
    lo, hi = (int(x) for x in a.completion_tokens.split("-"))
    grpo = (preset.get("trainer") or {}).get("grpo") or {}
    grpo = {**grpo, "max_seq_len": prompt_tokens + hi}
    specs = []
    for gs in parse_list(a.group_sizes):
        one = {**grpo, "micro_batch_tokens": a.groups * (prompt_tokens + gs * hi)}
        points = [("prefix_tree", order, one) for order in a.orders.split(",")] if a.orders else []
        for packing in PACKINGS if not a.orders else ():
            section = grpo
            if packing == "padded" and a.padded_micro_batch_tokens:
                section = {**grpo, "micro_batch_tokens": a.padded_micro_batch_tokens}
            points.append((packing, None, section))
        for packing, order, section in points:
            specs.append(
                dict(
                    kind="grpo",
                    packing=packing,
                    order=order,
                    group_size=gs,
                    groups=a.groups,
                    model=model,
                    section=section,
                    prompt_tokens=prompt_tokens,
                    completion=[lo, hi],
                )
            )
    if a.sft:
        for packing in PACKINGS:
            specs.append(
                dict(
                    kind="sft",
                    packing=packing,
                    model=model,
                    section=(preset.get("trainer") or {}).get("sft") or {},
                )
            )
    common = {"device": a.device, "steps": a.steps}
    if a.inputs:
        common["inputs"] = str(a.inputs.resolve())
    specs = [{**spec, **common} for spec in specs]
    if a.write_inputs:
        write_inputs(a.write_inputs, specs, a.rounds)
        return
    results: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(specs))}
    for rnd in range(a.rounds):
        for i, spec in enumerate(specs):
            r = run_child("bench.trainer.packing", {**spec, "seed": rnd})
            results[i].append(r)
            print(
                f"round {rnd} {spec['kind']} {spec['packing']} {spec.get('order') or ''} "
                f"G={spec.get('group_size', '-')}: {r['step_s']:.2f}s "
                f"peak {r.get('cuda_peak_mib', r['rss_peak_mib']):.0f} MiB",
                flush=True,
            )
    for i, spec in enumerate(specs):
        rs = results[i]
        row = {
            k: statistics.median(r[k] for r in rs)
            if isinstance(rs[0][k], (int, float))
            else rs[0][k]
            for k in rs[0]
        }
        row |= {
            "step_s_all": [r["step_s"] for r in rs],
            "rounds": a.rounds,
            "machine": machine(),
            "preset": a.preset,
            "model": Path(model).name,
        }
        row |= {k: v for k, v in spec.items() if k not in ("section", "seed")}
        where = "" if a.device == "cpu" else f"{a.device}/"
        key = f"{a.preset}/{where}{spec['kind']}/{spec['packing']}" + (
            f"/{spec['order']}" if spec.get("order") else ""
        )
        key += f"/G{spec['group_size']}" if spec["kind"] == "grpo" else ""
        write_result(a.out, key, row)
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()

"""TRL's side of ``bench/peers/peer_trl.py``: GRPOTrainer (TRL 1.16) on the stack's prompts and
reward, timed step by step; it generates with transformers ``generate`` (its CPU path) or, with
``use_vllm`` in the spec's keywords, with vLLM in its own process (``vllm_mode="colocate"``).

    python -m bench.peers.run_trl --spec WORK/trl/spec.json    (bench/peers/peer_trl.py writes it)

The spec names the model, the ``GRPOConfig`` keywords (bench/peers/settings.py
``trl_args``), the env's resolved config (prompts, reward), the thread count and
``reseed_after_vllm`` (``--trl-seed``: the generators seeded again once TRL's colocated
vLLM, which seeds them with 0, has started; None: as TRL leaves them). TRL itself
comes from the folder ``bench/peers/peer_trl.py`` puts on ``PYTHONPATH`` (``ensure_trl``).

Written into ``output_dir``: ``checkpoint-N/`` (TRL's own), ``peer_metrics.jsonl`` (one row
per optimizer step: end time, where the step's time went, TRL's logged metrics) and
``peer_summary.json`` (versions, threads, precision asked and observed, start-up times).
Where a step's time goes is measured by wrapping four of GRPOTrainer's methods (the
generation of completions, the reward call, the whole generate-and-score phase, the
checkpoint), with vLLM also its weight push (``sync_weights``, inside the generation), and by
the step callbacks; nothing in TRL's computation is changed. One thing in its weight push is:
where vLLM's CPU engine has packed its linear weights, TRL's own push fails, and
:func:`reload_through_vllm` loads the same tensors through vLLM's layerwise reload instead
(recorded as ``vllm_sync``; docs/results/peer_trl_vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def _timed(owner: Any, name: str, clock: dict[str, float]) -> None:
    """Replace ``owner.<name>`` by a wrapper adding its wall time to ``clock[name]``."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _dtype_probe(model: Any, seen: dict[str, str], no_grad: str = "generation") -> Any:
    """A forward hook on the first decoder layer's MLP: the dtype of its output without grad
    (``no_grad``: generating, or with vLLM generating, scoring) and while training (grad), i.e.
    what TRL's precision really is."""
    import torch

    layers = model.model.layers if hasattr(model, "model") else model.base_model.model.layers

    def hook(_m: Any, _i: Any, out: Any) -> None:
        seen.setdefault("training" if torch.is_grad_enabled() else no_grad, str(out.dtype))

    return layers[0].mlp.register_forward_hook(hook)


def _vllm_summary(trainer: Any) -> dict[str, str]:
    """vLLM's version and the dtype its engine computes in (TRL's colocated ``LLM``)."""
    import vllm

    config = trainer.vllm_generation.llm.llm_engine.model_config
    return {"vllm_version": vllm.__version__, "vllm_dtype": str(config.dtype)}


def vllm_model(generation: Any) -> Any:
    """The model of TRL's colocated vLLM engine (the object TRL's own push loads into)."""
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def vllm_packed_linears(model: Any) -> int:
    """Linear layers whose weight vLLM's CPU engine has packed for its own GEMM kernels
    (oneDNN or sgl-kernel: ``cpu_linear`` set, ``layer.weight`` emptied). TRL's colocate sync
    cannot update those: ``model.load_weights`` finds no ``weight_loader`` on the emptied
    parameter (AttributeError; docs/results/peer_trl_vllm.md)."""
    return sum(
        1
        for m in model.modules()
        if hasattr(m, "cpu_linear")
        and getattr(m, "weight", None) is not None
        and m.weight.numel() == 0
    )


def reload_through_vllm(generation: Any) -> None:
    """Make TRL's colocate ``sync_weights`` work on vLLM's CPU engine: TRL still walks its own
    parameters (its FSDP/PEFT handling unchanged), but instead of loading each into vLLM on
    its own, the tensors are collected and loaded in one pass of vLLM's layerwise-reload
    lifecycle (initialize -> ``load_weights`` -> finalize, which packs every layer again),
    the way this stack's bridge loads them (``vllm_patching.engines.apply.apply_weights``,
    also re-packing a tied ``lm_head``); then vLLM's prefix cache is reset again."""
    from vllm_patching.engines.apply import apply_weights

    llm, model = generation.llm, vllm_model(generation)
    trl_sync = generation.sync_weights

    def sync_weights() -> None:
        got: list[tuple[str, Any]] = []
        model.load_weights = lambda weights: got.extend((n, t.detach().clone()) for n, t in weights)
        try:
            trl_sync()
        finally:
            del model.load_weights
        n = apply_weights(model, llm.llm_engine.model_config, got)
        llm.reset_prefix_cache()
        print(f"[trl] vLLM weight sync: {n} tensors through vLLM's layerwise reload", flush=True)

    generation.sync_weights = sync_weights


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t_start = time.time()
    threads = int(spec["threads"])
    import torch

    torch.set_num_threads(threads)
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.peers.data import ShopR1Reward, rows_in_env_order, trl_rows
    from env_server.config import EnvConfig

    t_imported = time.time()
    env = EnvConfig.model_validate(spec["env"])
    out = Path(spec["trl_args"]["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    bf16 = spec["bf16"]
    why = spec.get("precision_why", "as ours")
    if bf16 is None:  # an older spec: the same decision procedure as our trainer
        from trainer.precision import choose_precision

        dtype, why = choose_precision(spec["precision"], torch.device("cpu"))
        bf16 = dtype == torch.bfloat16
    print(f"[trl] TRL {trl.__version__} ({trl.__file__}); bf16={bf16} ({why})", flush=True)

    tok = AutoTokenizer.from_pretrained(spec["model"])
    rows = rows_in_env_order(env.data_dir, env.num_sessions, env.seed, spec["prompts"])
    data = trl_rows(rows, tok, env.max_prompt_tokens, env.latest_only)  # checks every prompt
    tok.padding_side = "left"  # GRPOTrainer's generate pads prompts on the left
    args = GRPOConfig(**{**spec["trl_args"], "bf16": bf16})
    clock: dict[str, float] = {}
    metrics = (out / "peer_metrics.jsonl").open("w")
    seen: dict[str, str] = {}
    state: dict[str, Any] = {}

    use_vllm = bool(spec["trl_args"].get("use_vllm"))
    if use_vllm:  # vLLM's CPU engine in this process: a small KV cache, no usage report
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=ShopR1Reward(env.reward_config()),
        args=args,
        train_dataset=Dataset.from_list(data),
        processing_class=tok,
    )
    for name in (
        "_generate_single_turn",
        "_calculate_rewards",
        "_generate_and_score_completions",
        "training_step",
        "_save_checkpoint",
    ):
        _timed(trainer, name, clock)
    vllm_sync = None
    if use_vllm:
        packed = vllm_packed_linears(vllm_model(trainer.vllm_generation))
        vllm_sync = "TRL's load_weights, one parameter at a time"
        if packed:
            reload_through_vllm(trainer.vllm_generation)
            vllm_sync = (
                f"vLLM's layerwise reload ({packed} linear layers packed by vLLM's CPU engine, "
                "which TRL's load_weights cannot update)"
            )
        print(f"[trl] vLLM weight sync: {vllm_sync}", flush=True)
        _timed(trainer.vllm_generation, "sync_weights", clock)
    state["probe"] = _dtype_probe(trainer.model, seen, "scoring" if use_vllm else "generation")
    if spec.get("reseed_after_vllm") is not None:
        # vLLM's worker, in this process, seeded torch/numpy/random with 0 as it started (TRL
        # 1.16 gives it seed=process_index); seeded again, TRL samples from this seed's stream
        from transformers import set_seed

        set_seed(spec["reseed_after_vllm"])
        print(f"[trl] generators seeded {spec['reseed_after_vllm']} after vLLM's start", flush=True)

    def write_row(step: int) -> None:
        gen_score = clock.get("_generate_and_score_completions", 0.0)
        train_step = clock.get("training_step", 0.0)
        logs = state.get("logs", {})
        row = {
            "step": step,
            "time": round(time.time(), 3),
            "step_s": state["step_s"],
            "generate_s": clock.get("_generate_single_turn", 0.0),
            "weight_sync_s": clock.get("sync_weights") if use_vllm else None,
            "reward_s": clock.get("_calculate_rewards", 0.0),
            "score_other_s": gen_score
            - clock.get("_generate_single_turn", 0.0)
            - clock.get("_calculate_rewards", 0.0),
            "loss_backward_s": train_step - gen_score,
            "optimizer_s": state["step_s"] - train_step,
            "checkpoint_s": clock.get("_save_checkpoint", 0.0),
            "reward_mean": logs.get("reward"),
            "reward_std": logs.get("reward_std"),
            "frac_reward_zero_std": logs.get("frac_reward_zero_std"),
            "completion_tokens": logs.get("completions/mean_length"),
            "entropy": logs.get("entropy"),
            "loss": logs.get("loss"),
            "vllm_logp_difference": logs.get("sampling/sampling_logp_difference/mean"),
        }
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
        print(
            f"[trl] step {step}/{args.max_steps}: {row['step_s']:.1f}s "
            f"(generate {row['generate_s']:.1f}s, loss+backward {row['loss_backward_s']:.1f}s, "
            f"checkpoint {row['checkpoint_s']:.1f}s) reward {row['reward_mean']}",
            flush=True,
        )

    class StepClock(TrainerCallback):
        """A step's row is written when the next step begins (or training ends): by then
        TRL has logged it (``on_log``) and saved its checkpoint, if it had one."""

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            state["train_begin"] = time.time()

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if state.get("pending") is not None:
                write_row(state.pop("pending"))
            clock.clear()
            state["logs"] = {}
            state["begin"] = time.perf_counter()

        def on_step_end(self, _args: Any, st: Any, *_: Any, **__: Any) -> None:
            state["step_s"] = time.perf_counter() - state["begin"]
            state["pending"] = st.global_step
            if "probe" in state:
                state.pop("probe").remove()

        def on_log(self, _args: Any, _st: Any, _c: Any, logs: Any = None, **__: Any) -> None:
            state.setdefault("logs", {}).update(logs or {})

        def on_train_end(self, *_: Any, **__: Any) -> None:
            if state.get("pending") is not None:
                write_row(state.pop("pending"))

    trainer.add_callback(StepClock())
    t_loaded = time.time()
    trainer.train()
    metrics.close()
    summary = {
        "trl_version": trl.__version__,
        "generation": "vllm-colocate" if use_vllm else "transformers",
        **(_vllm_summary(trainer) | {"vllm_sync": vllm_sync} if use_vllm else {}),
        "trl_file": trl.__file__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bf16": bf16,
        "precision_why": why,
        "mixed_precision": str(trainer.accelerator.mixed_precision),
        "observed_dtype": seen,
        "prompts_checked": len(data),
        "import_s": t_imported - t_start,
        "load_s": t_loaded - t_imported,
        "train_begin": state.get("train_begin"),
        "train_end": time.time(),
    }
    (out / "peer_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.peers.run_trl",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "--spec", type=Path, required=True, help="JSON written by bench/peers/peer_trl.py"
    )
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(run(json.loads(a.spec.read_text()))), flush=True)


if __name__ == "__main__":
    main()

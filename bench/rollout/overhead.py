"""Rollout overhead: completion tokens/s through the environment service + API vs the same
vLLM server driven directly with the same requests.

    flock /tmp/heavy.lock .venv/bin/python -m bench.rollout.overhead [--model tiny]
        [--points 8:4,4:4,16:4,8:1,8:2] [--groups 8] [--reps 3] [--max-tokens 96]

Starts one patched vLLM server (``vllm_patching``, mode shared_vllm, CPU) on the chosen model
and one batching API (``python -m api``), then for every ``group size:concurrency`` point runs
``--reps`` interleaved pairs:

- direct: an ideal client -- ``httpx.AsyncClient`` posting the env's exact ``/v1/completions``
  body (token-id prompt, ``n = group size``, same ``max_tokens``/temperature/top_p,
  ``logprobs: 0``, ``return_token_ids``) for ``--groups`` prompts, ``--concurrency`` in flight,
  prompts tokenized beforehand;
- through: the real ``env_server.service.EnvService`` (tokenizing each prompt, asking the API
  for backpressure, sampling via ``InferenceClient``, scoring with the Shop-R1 reward, building
  the scored group, pushing it to the API) over the same prompts in the same order, with the
  same concurrency, until ``--groups`` groups are pushed.

Rate = completion tokens / wall seconds of the whole pass. Overhead = 1 - through/direct on
the medians (per-pair spread recorded). Results are merged into
docs/results/rollout_overhead.json under the key ``<model>/gs<G>/c<C>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    MODEL_SIZES,
    REAL_MODELS,
    RESULTS,
    count_params,
    machine,
    model_dir,
    overhead,
    parse_points,
    stop_on_sigterm,
    write_result,
)


async def direct_pass(
    url: str, model: str, prompts: list[list[int]], args, gs: int, conc: int
) -> dict[str, float]:
    """Every prompt once, ``conc`` in flight, straight to vLLM. Returns tokens and seconds."""
    import httpx

    sem = asyncio.Semaphore(conc)
    tokens = 0

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        nonlocal tokens
        body = {
            "model": model,
            "prompt": ids,
            "n": gs,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        async with sem:
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            tokens += sum(len(c["token_ids"]) for c in r.json()["choices"])

    timeout = httpx.Timeout(600.0, connect=5.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def through_pass(
    api_url: str,
    url: str,
    model: str,
    rows: list[dict],
    tokenizer: Any,
    args,
    gs: int,
    conc: int,
    env_name: str,
) -> dict[str, float]:
    """The env service over the same rows, until ``len(rows)`` groups are pushed."""
    from env_server.config import EnvConfig
    from env_server.inference import InferenceClient
    from env_server.service import ApiLink, EnvService

    cfg = EnvConfig(
        api_url=api_url,
        inference_url=url,
        model=model,
        env_name=env_name,
        group_size=gs,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        concurrency=conc,
        drop_constant_groups=False,
        max_groups=len(rows),
        log_every_s=3600,
    )
    inference = InferenceClient(url, model)
    tokens = 0
    complete = inference.complete

    async def counting(*a: Any, **kw: Any):  # count what vLLM generated, as direct does
        nonlocal tokens
        batch = await complete(*a, **kw)
        tokens += sum(len(c.token_ids) for c in batch.completions)
        return batch

    inference.complete = counting  # type: ignore[method-assign]
    splits = {"train": _Rows(rows), "validation": _Rows(rows[:1])}
    service = EnvService(cfg, ApiLink(cfg), inference, tokenizer, splits)
    service.rows = iter(rows)  # same prompts, same order as the direct pass
    try:
        t0 = time.perf_counter()
        stats = await service.run()
        wall = time.perf_counter() - t0
    finally:
        await inference.aclose()
    if stats.pushed != len(rows) or stats.failed:
        raise RuntimeError(f"through pass pushed {stats.pushed}/{len(rows)}, failed {stats.failed}")
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


class _Rows:
    """The two methods EnvService needs of a datasets split."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def to_list(self) -> list[dict]:
        return list(self.rows)


def run_point(
    api_url: str,
    server_url: str,
    model: str,
    rows: list[dict],
    prompts,
    tokenizer,
    args,
    gs: int,
    conc: int,
) -> dict:
    direct, through = [], []
    for rep in range(args.reps):
        # Alternate which goes first: a load change on the shared box hits both equally.
        order = ("direct", "through") if rep % 2 == 0 else ("through", "direct")
        for kind in order:
            if kind == "direct":
                r = asyncio.run(direct_pass(server_url, model, prompts, args, gs, conc))
                direct.append(r)
            else:
                env = f"bench_gs{gs}_c{conc}_r{rep}"
                r = asyncio.run(
                    through_pass(api_url, server_url, model, rows, tokenizer, args, gs, conc, env)
                )
                through.append(r)
            print(
                f"  gs={gs} c={conc} rep={rep} {kind:8s} {r['tokens']:6d} tok "
                f"{r['wall_s']:6.2f}s {r['tokens_per_s']:7.1f} tok/s",
                flush=True,
            )
    summary = overhead([d["tokens_per_s"] for d in direct], [t["tokens_per_s"] for t in through])
    return {
        "group_size": gs,
        "concurrency": conc,
        "groups": len(rows),
        "direct": direct,
        "through": through,
        **summary,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        "python -m bench.rollout.overhead",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument(
        "--model",
        choices=[*sorted(MODEL_SIZES), *REAL_MODELS],
        default="tiny",
        help="model size (bench/common.py MODEL_SIZES; built on first use), or smol "
        "(SmolLM2-135M-Instruct, trainer.smol_model)",
    )
    ap.add_argument(
        "--points",
        default="8:4",
        help="comma list of group_size:concurrency (prompts in flight) points",
    )
    ap.add_argument("--groups", type=int, default=8, help="prompts (groups) per pass")
    ap.add_argument("--reps", type=int, default=3, help="interleaved direct/through pairs")
    ap.add_argument("--max-tokens", type=int, default=96, help="completion budget (cpu-tiny)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="prompt budget")
    ap.add_argument(
        "--warmup", type=int, default=1, help="unmeasured direct passes over all prompts first"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "rollout_overhead.json")
    args = ap.parse_args()
    stop_on_sigterm()

    from transformers import AutoTokenizer

    from env_server.data.dataset import load_or_build
    from env_server.rollout import prompt_ids
    from launch.procs import ManagedProcess
    from launch.vllm_server import start_bridge_server
    from settings.paths import DATA_DIR
    from settings.ports import free_port

    mdir = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(mdir)
    rows = load_or_build(DATA_DIR)["train"].select(range(args.groups)).to_list()
    prompts = [prompt_ids(r, tokenizer, args.max_prompt_tokens, False) for r in rows]
    before = machine()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        # A huge default batch: backpressure never throttles (no trainer leases here).
        api = ManagedProcess(
            "api",
            [
                sys.executable,
                "-m",
                "api",
                "--port",
                str(port),
                "--db-path",
                str(work / "api.sqlite"),
                "--log-level",
                "warning",
                "--default-batch-sequences",
                "1000000",
            ],
            work / "api.log",
        ).start()
        server = None
        try:
            api_url = f"http://127.0.0.1:{port}"
            api.wait_http(api_url + "/health", timeout=60)
            t0 = time.perf_counter()
            server = start_bridge_server(mdir, "shared_vllm", work / "vllm.log", token="bench")
            startup_s = time.perf_counter() - t0
            url, model = server.base_url, server.served_model_name
            # One-off costs (first compilation, prefix cache of every prompt) are paid here,
            # not by whichever pass happens to run first.
            for _ in range(args.warmup):
                asyncio.run(direct_pass(url, model, prompts, args, 2, 4))
            for gs, conc in parse_points(args.points):
                res = run_point(api_url, url, model, rows, prompts, tokenizer, args, gs, conc)
                res.update(
                    model=args.model,
                    params=count_params(mdir),
                    max_tokens=args.max_tokens,
                    mean_prompt_tokens=sum(map(len, prompts)) / len(prompts),
                    vllm_startup_s=startup_s,
                    machine_before=before,
                    machine_after=machine(),
                )
                write_result(args.out, f"{args.model}/gs{gs}/c{conc}", res)
                print(
                    f"{args.model} gs={gs} c={conc}: direct {res['direct_median']:.1f} "
                    f"through {res['through_median']:.1f} tok/s, overhead "
                    f"{100 * res['overhead']:+.1f}% (pairs {100 * res['overhead_pair_min']:+.1f}"
                    f"..{100 * res['overhead_pair_max']:+.1f}%)",
                    flush=True,
                )
        finally:
            if server is not None:
                server.stop()
            api.stop()
    os.sync()


if __name__ == "__main__":
    main()

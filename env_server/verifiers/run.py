"""The verifiers environment service, run inside the verifiers venv (``__main__.py`` execs it).

    load the env with verifiers' loader (vf.load_environment), register with the API
    loop: wanted = API backpressure
          each wanted group: next task -> group_size episodes (env.run_episode, train client
          -> recording proxy -> our vLLM /inference/v1/generate) -> every trainable branch
          -> ScoredSequence (convert.py, checked against the recorded exchanges) -> push

The env's own rewards score each trace (``trace.reward``); nothing is re-rendered. Refused
branches are logged with their reason and counted (``refused_<code>`` in the summary).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from env_server.verifiers.config import VerifiersConfig
from env_server.verifiers.convert import (
    Refused,
    Turn,
    branch_to_sequence,
    group_version,
    index_turns,
)
from env_server.verifiers.proxy import RecordingProxy

log = logging.getLogger("env_server.verifiers")


def load_env(cfg: VerifiersConfig) -> Any:
    """The user's environment through verifiers' own loader (``vf.load_environment``): the
    env config narrowed to the env's type (``vf.resolve_env_config``), the taskset's knobs
    from ``--env-args``, and every role whose runtime the env's author left at verifiers'
    default (a remote sandbox) and ``--env-config`` does not set runs in ``--runtime``."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    paths = [str(Path(p).resolve()) for p in cfg.env_path]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    if paths:  # the harness programs verifiers starts import as we do
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    raw: dict[str, Any] = json.loads(cfg.env_config or "{}")
    raw["taskset"] = {**raw.get("taskset", {}), **json.loads(cfg.env_args or "{}")}
    raw["taskset"]["id"] = cfg.env_id
    resolved = vf.resolve_env_config(raw)
    for name, role in agent_config_fields(resolved).items():
        given = raw.get(name) if isinstance(raw.get(name), dict) else {}
        if "runtime" not in given and isinstance(role.runtime, vf.PrimeConfig):
            raw[name] = {**given, "runtime": {"type": cfg.runtime}}
    return vf.load_environment(vf.resolve_env_config(raw))


def cycle_tasks(env: Any, seed: int) -> Iterator[Any]:
    """The taskset's tasks in a seeded order, reshuffled every epoch (an infinite taskset:
    in its own order)."""
    taskset = env.taskset
    if not taskset.bounded:
        yield from iter(taskset)
        return
    tasks = list(taskset)
    if not tasks:
        raise ValueError("the taskset has no tasks")
    rng = random.Random(f"verifiers-order-{seed}")
    for epoch in itertools.count():
        order = list(range(len(tasks)))
        rng.shuffle(order)
        yield from (tasks[i] for i in order)
        log.info("finished epoch %d over %d tasks", epoch + 1, len(tasks))


async def discover(url: str) -> tuple[str, str | None]:
    """Served model name and its path (the renderer's tokenizer), asked of the server."""
    async with httpx.AsyncClient(timeout=30) as http:
        first = (await http.get(url.rstrip("/") + "/v1/models")).json()["data"][0]
        return first["id"], first.get("root")


async def model_context(cfg: VerifiersConfig, proxy_url: str) -> Any:
    """verifiers' model context for ``cfg``: its train client pointed at the recording proxy
    at ``proxy_url``, the renderer's tokenizer the model path the server reports, and the
    sampling of every turn (``--sampling`` extras included). The service's rollouts and the
    held-out evaluation (``evaluate.py``) sample through the same one."""
    import verifiers.v1 as vf

    model, root = await discover(cfg.inference_url)
    model = cfg.model or model
    client = vf.TrainClientConfig(
        base_url=proxy_url + "/v1",
        api_key_var="SHOP_R1_VERIFIERS_INFERENCE_KEY",
        renderer=json.loads(cfg.renderer) if cfg.renderer else None,
        renderer_model_name=cfg.tokenizer or root or model,
    )
    sampling = vf.SamplingConfig(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        **json.loads(cfg.sampling or "{}"),
    )
    return vf.ModelContext(model=model, client=client, sampling=sampling)


class Service:
    def __init__(self, cfg: VerifiersConfig, env: Any, proxy: RecordingProxy) -> None:
        from api.client import ApiClient

        self.cfg, self.env, self.proxy = cfg, env, proxy
        self.api = ApiClient(cfg.api_url, token=cfg.api_token, give_up_s=cfg.reconnect_timeout_s)
        self.api_version = 0
        self.tasks = cycle_tasks(env, cfg.seed)
        self.counts: Counter[str] = Counter()
        self.ctx: Any = None

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        if self.cfg.metrics_path is None:
            return
        self.cfg.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.cfg.metrics_path.open("a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **payload}) + "\n")

    async def context(self) -> Any:
        return await model_context(self.cfg, self.proxy.url)

    async def rollout_group(self) -> dict[str, Any] | None:
        """One task's ``group_size`` episodes as a scored group (None: nothing trainable)."""
        task = next(self.tasks)
        episodes = await asyncio.gather(
            *(self.env.run_episode(task, self.ctx) for _ in range(self.cfg.group_size))
        )
        sequences: list[dict[str, Any]] = []
        versions: list[int | None] = []
        turn_versions: list[list[int | None]] = []
        rewards: list[float] = []
        turns_per_trace: list[int] = []
        components: dict[str, list[float]] = {}
        by_prompt = index_turns(self.proxy.recorded())
        matched: list[Turn] = []
        for ep in episodes:
            for trace in ep.traces:
                if not ep.ok or not trace.ok:
                    self.counts["failed_traces"] += 1
                    err = trace.last_error or ep.last_error
                    log.warning("trace %s failed: %s", trace.id, err and err.message)
                    continue
                if not trace.agent.trainable:
                    continue
                for branch in trace.branches:
                    if not branch.trainable:
                        continue
                    try:
                        conv = branch_to_sequence(
                            branch.token_ids,
                            branch.sampled_mask,
                            branch.logprobs,
                            trace.reward,
                            branch.advantages,
                            by_prompt,
                        )
                    except Refused as e:
                        self.counts[f"refused_{e.code}"] += 1
                        log.error(
                            "refused a branch of trace %s (task %s): %s", trace.id, task.data.idx, e
                        )
                        continue
                    matched.extend(conv.turns)
                    sequences.append(conv.sequence)
                    versions.extend(conv.versions)
                    turn_versions.append(conv.versions)
                    rewards.append(trace.reward)
                    turns_per_trace.append(len(conv.runs))
                    for k, r in trace.rewards.items():
                        if r is not None:
                            components.setdefault(f"reward/{k}", []).append(r.score)
                    for k, m in trace.metrics.items():
                        if m is not None:
                            components.setdefault(f"metric/{k}", []).append(float(m))
        self.proxy.forget(matched)
        if len(sequences) < 2:
            self.counts["groups_too_small"] += 1
            return None
        if self.cfg.drop_constant_groups and len(set(rewards)) == 1:
            self.counts["dropped_constant"] += 1
            return None
        fallback = self.api_version
        metrics: dict[str, Any] = {
            "reward": sum(rewards) / len(rewards),
            "turns": sum(turns_per_trace) / len(turns_per_trace),
            **{k: sum(v) / len(v) for k, v in components.items()},
        }
        known = [v for v in versions if v is not None]
        if known and min(known) != max(known):
            metrics["weight_versions"] = ",".join(map(str, sorted(set(known))))
            metrics["weight_version_spread"] = max(known) - min(known)
        return {
            "group_id": str(uuid.uuid4()),
            "env": self.cfg.env_name,
            "policy_version": group_version(versions, fallback),
            "sequences": sequences,
            "metrics": metrics,
            "extras": {
                "verifiers": {
                    "env_id": self.cfg.env_id,
                    "task": {"idx": task.data.idx, "id": task.data.id, "name": task.data.name},
                    "turn_versions": turn_versions,
                }
            },
        }

    async def one(self) -> None:
        try:
            group = await self.rollout_group()
        except Exception as e:  # noqa: BLE001 - a failed group is logged and counted
            self.counts["failed_groups"] += 1
            log.exception("a group failed: %r", e)
            return
        if group is None:
            return
        await asyncio.to_thread(self.api.push_groups, [group])
        self.counts["pushed"] += 1
        self.record("group", {"policy_version": group["policy_version"], **group["metrics"]})

    async def run(self) -> dict[str, Any]:
        c = self.cfg
        await asyncio.to_thread(self.api.register_env, c.env_name, c.env_weight, c.group_size)
        self.ctx = await self.context()
        in_flight: set[asyncio.Task] = set()
        last_log = time.monotonic()
        while c.max_groups is None or self.counts["pushed"] < c.max_groups:
            bp = await asyncio.to_thread(self.api.wanted, c.env_name)
            self.api_version = int(bp.policy_version)
            room = min(int(bp.wanted), c.concurrency) - len(in_flight)
            if c.max_groups is not None:
                room = min(room, c.max_groups - self.counts["pushed"] - len(in_flight))
            for _ in range(max(0, room)):
                t = asyncio.create_task(self.one())
                in_flight.add(t)
                t.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.wait(in_flight, timeout=c.poll_interval_s)
            else:
                await asyncio.sleep(c.poll_interval_s)
            if (
                self.counts["failed_groups"] >= c.max_consecutive_failures
                and not self.counts["pushed"]
            ):
                raise RuntimeError(f"{self.counts['failed_groups']} groups failed, none pushed")
            if time.monotonic() - last_log > c.log_every_s:
                last_log = time.monotonic()
                log.info("%s; generate exchanges %d", dict(self.counts), self.proxy.exchanges)
        if in_flight:
            await asyncio.gather(*in_flight)
        summary = {**self.counts, "exchanges": self.proxy.exchanges}
        log.info("done: %s", summary)
        self.record("summary", summary)
        return summary


def children_die_with_us() -> None:
    """verifiers' subprocess runtime starts each harness program (and its ``uv`` set-up) with
    ``asyncio.create_subprocess_exec(..., start_new_session=True)``: a session of its own, out
    of reach of a signal to ours. Each such child asks the kernel to SIGKILL it when this
    service exits (``procutil.parent_death``, between fork and exec, as the lifeline does)."""
    from procutil import parent_death

    if not parent_death.SUPPORTED:
        return
    spawn, me = asyncio.create_subprocess_exec, os.getpid()

    async def spawn_dying_with_us(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        kwargs.setdefault("preexec_fn", functools.partial(parent_death.die_with, me))
        return await spawn(*args, **kwargs)

    asyncio.create_subprocess_exec = spawn_dying_with_us  # type: ignore[assignment]


async def serve(cfg: VerifiersConfig) -> dict[str, Any]:
    children_die_with_us()
    env = load_env(cfg)
    proxy = RecordingProxy(cfg.inference_url, cfg.request_timeout_s, cfg.record_path)
    await proxy.start()
    try:
        async with env.serving():
            return await Service(cfg, env, proxy).run()
    finally:
        await proxy.stop()


def main(argv: list[str] | None = None) -> None:
    from env_server.verifiers.config import parse_config

    cfg = parse_config(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    summary = asyncio.run(serve(cfg))
    if cfg.summary_path is not None:
        Path(cfg.summary_path).write_text(json.dumps(summary))

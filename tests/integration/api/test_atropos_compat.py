"""Our API driven by atroposlib 0.4.0's own code, and the same tests against Atropos's own
``run-api`` (so the expectations are Atropos's, not ours).

atroposlib lives in its own virtualenv (``bench.api.servers.ensure_atropos``: built from
PyPI on first use under ``artifacts/venvs/atropos`` and reused afterwards), never in the
project's. Three copies of one ``BaseEnv`` subclass, all named ``toy`` and one of them with
``inference_weight=-1``, run atroposlib's ``serve`` CLI against a small OpenAI-compatible
server (``atropos_toy_env.py``); atroposlib's example trainer registers and runs its
``get_data`` loop (``atropos_trainer.py``). Checked: every env runs to its end (exit 0),
every served batch holds exactly ``batch_size`` sequences, no group is served twice, every
served group is one an env posted, served with every field as posted, each env's groups carry
one env id of their own (over the envs the batches served: which ones is up to the envs'
start-up), and every group the API acknowledged is served or still queued.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from api.atropos_packing import (
    EnvAllocation,
    QueueItem,
    find_groups_summing_to_target,
    grab_exact,
    grab_with_min_allocations,
)
from bench.api.servers import atropos_api_argv, ensure_atropos
from launch.procs import ManagedProcess, tail
from settings.ports import free_port

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent.resolve().parent
BATCH = 8
GROUP = 4
TOTAL_STEPS = 6


@pytest.fixture(scope="module")
def atropos_python() -> Path:
    return ensure_atropos()


@pytest.fixture(scope="module")
def tokenizer(atropos_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    script = str(HERE / "atropos_toy_env.py")
    subprocess.run([str(atropos_python), script, "make-tokenizer", str(out)], check=True)
    return out


def start(name: str, argv: list[str], log: Path, url: str, **env: str) -> ManagedProcess:
    proc = ManagedProcess(name, argv, log, env={**os.environ, **env}).start()
    try:
        proc.wait_http(url, timeout=120)
    except BaseException:
        proc.stop()
        raise
    return proc


def start_api(server: str, py: Path, tmp: Path) -> tuple[ManagedProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if server == "atropos":
        argv = atropos_api_argv(py, port)
    else:
        argv = [
            sys.executable,
            "-m",
            "api",
            "--port",
            str(port),
            "--db-path",
            str(tmp / "api.sqlite"),
            "--log-level",
            "warning",
        ]
    return start(server, argv, tmp / f"{server}.log", url + "/"), url


def env_config(tmp: Path, k: int, api: str, openai: str, tokenizer: Path, weight: float) -> Path:
    import yaml

    cfg = {
        "env": {
            "rollout_server_url": api,
            "tokenizer_name": str(tokenizer),
            "group_size": GROUP,
            "total_steps": TOTAL_STEPS,
            "inference_weight": weight,
            "use_wandb": False,
            "max_token_length": 64,
            "max_num_workers": 4,
            "wandb_name": "toy",
        },
        "openai": {
            "base_url": openai + "/v1",
            "api_key": "x",
            "model_name": "toy",
            "server_type": "openai",
        },
    }
    path = tmp / f"env{k}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("server", ["ours", "atropos"])
def test_atroposlib_envs_and_example_trainer(
    server: str, atropos_python: Path, tokenizer: Path, tmp_path: Path
) -> None:
    py, toy = str(atropos_python), str(HERE / "atropos_toy_env.py")
    oport = free_port()
    procs: list[ManagedProcess] = []
    try:
        oai = start(
            "openai",
            [py, toy, "openai-server", str(oport)],
            tmp_path / "openai.log",
            f"http://127.0.0.1:{oport}/docs",
        )
        procs.append(oai)
        api, url = start_api(server, atropos_python, tmp_path)
        procs.append(api)
        out, stop = tmp_path / "served.json", tmp_path / "stop"
        trainer = ManagedProcess(
            "trainer",
            [
                py,
                str(HERE / "atropos_trainer.py"),
                url,
                str(BATCH),
                str(out),
                str(stop),
                sysconfig.get_paths()["purelib"],
            ],
            tmp_path / "trainer.log",
        ).start()
        procs.append(trainer)
        records = tmp_path / "records"
        records.mkdir()
        envs = []
        for k, weight in enumerate([1.0, 1.0, -1.0]):
            cfg = env_config(tmp_path, k, url, f"http://127.0.0.1:{oport}", tokenizer, weight)
            envs.append(
                ManagedProcess(
                    f"env{k}",
                    [py, toy, "serve", "--config", str(cfg)],
                    tmp_path / f"env{k}.log",
                    env={**os.environ, "TOY_RECORD_DIR": str(records)},
                )
            )
        procs.extend(e.start() for e in envs)
        deadline = time.monotonic() + 900  # generous: a busy 2-core box
        while any(e.alive() for e in envs) and time.monotonic() < deadline:
            assert trainer.alive(), tail(trainer.log_path)
            time.sleep(1)
        for e in envs:
            assert not e.alive(), f"{e.name} did not finish:\n{tail(e.log_path)}"
            assert e.popen.returncode == 0, f"{e.name} failed:\n{tail(e.log_path)}"
        stop.touch()
        assert trainer.wait_exit() == 0, tail(trainer.log_path)  # waits while it logs
        left = httpx.get(url + "/status", timeout=30).json()["queue_size"]
    finally:
        for p in reversed(procs):
            p.stop()

    served_run = json.loads(out.read_text())
    batches = [r["batch"] for r in served_run["replies"]]
    assert batches and served_run["padded_batches"] == len(batches)
    assert {sum(len(g["tokens"]) for g in b) for b in batches} == {BATCH}
    served = [g for b in batches for g in b]
    uid = Counter(g["group_overrides"]["toy_uid"] for g in served)
    assert max(uid.values()) == 1, "a group was served twice"
    intents, acked = {}, set()
    for f in records.glob("env-*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = r["group"]["group_overrides"]["toy_uid"]
            if r["event"] == "intent":
                intents[key] = r["group"]
            else:
                acked.add(key)
    for g in served:  # every field as posted (distill_* included), None where not posted
        posted = intents[g["group_overrides"]["toy_uid"]]
        assert {k: v for k, v in g.items() if v is not None} == {
            k: v for k, v in posted.items() if v is not None
        }
    assert len(acked - set(uid)) <= left < BATCH // GROUP  # the rest: less than a batch
    # each env's groups carry one env id, and two envs never share one: measured over the envs
    # the batches happened to serve (which ones is up to the envs' start-up, not the API)
    ids: dict[str, set[int]] = {}
    for g in served:  # toy_uid = "<the env's PID>-<counter>-<item>"
        ids.setdefault(g["group_overrides"]["toy_uid"].split("-")[0], set()).add(g["env_id"])
    assert all(len(v) == 1 for v in ids.values()), ids
    env_ids = [min(v) for v in ids.values()]
    assert len(set(env_ids)) == len(env_ids) and set(env_ids) <= {0, 1, 2}, ids
    print(f"ATROPOS_COMPAT envs served: {ids}")


def test_packing_port_matches_atroposlib(atropos_python: Path) -> None:
    """Our port of atroposlib's packing picks the same groups as atroposlib's own code."""
    rng = random.Random(0)
    cases = []
    for _ in range(300):
        sizes = [rng.choice([1, 2, 4, 8, 3, 16]) for _ in range(rng.randrange(0, 14))]
        envs = [rng.choice([None, 0, 1, 2]) for _ in sizes]
        allocs = [[i, rng.random() < 0.8, rng.choice([None, 0.25, 0.5, 0.75])] for i in range(3)]
        cases.append(
            {
                "sizes": sizes,
                "envs": envs,
                "batch": rng.choice([4, 8, 16]),
                "allocs": allocs,
                "target": rng.choice([2, 4, 8]),
            }
        )
    script = """
import json, sys
from atroposlib.api.utils import (find_groups_summing_to_target,
    grab_batch_with_minimum_allocations, grab_exact_from_heterogeneous_queue)
out = []
for c in json.load(sys.stdin):
    queue = [{"tokens": [[0]] * s, "env_id": e, "i": i}
             for i, (s, e) in enumerate(zip(c["sizes"], c["envs"]))]
    envs = [{"registered_id": i, "connected": con, "min_batch_allocation": m}
            for i, con, m in c["allocs"]]
    exact, _ = grab_exact_from_heterogeneous_queue(queue, c["batch"])
    mins, _ = grab_batch_with_minimum_allocations(queue, c["batch"], envs)
    out.append({"exact": exact and [g["i"] for g in exact],
                "mins": mins and [g["i"] for g in mins],
                "find": find_groups_summing_to_target(queue, c["target"])})
print(json.dumps(out))
"""
    res = subprocess.run(
        [str(atropos_python), "-c", script],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        check=True,
    )
    theirs = json.loads(res.stdout)
    for c, t in zip(cases, theirs, strict=True):
        queue = [QueueItem(s, e) for s, e in zip(c["sizes"], c["envs"], strict=True)]
        allocs = [EnvAllocation(*a) for a in c["allocs"]]
        assert grab_exact(c["sizes"], c["batch"]) == (t["exact"] or None), c
        assert grab_with_min_allocations(queue, c["batch"], allocs) == (t["mins"] or None), c
        assert find_groups_summing_to_target(c["sizes"], c["target"]) == t["find"], c

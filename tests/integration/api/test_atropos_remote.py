"""An unchanged atroposlib env on another machine reaches a token-protected API (issue 48).

atroposlib 0.4.0 sends no auth header, so the API also takes the token in the path: the
capability URL ``http://HOST:PORT/t/<token>`` is the env's ``rollout_server_url`` (and the
example trainer's ``atropos_url``). Two machines are two network namespaces this test creates
(``ip netns add``; a veth pair between them, 10.250.0.1 and 10.250.0.2; nothing in the
host's own namespace changes): the API listens on 10.250.0.1 in one, and atroposlib's own
code (the toy env through its ``serve`` CLI, the example trainer's ``register_trainer`` +
``get_data`` loop, both unchanged: atropos_toy_env.py, atropos_trainer.py) runs in the other.

Checked: the API refuses to start on that address without a token (exit 1, saying how to set
one); with one, from the other address the plain URL answers 401 and the capability URL 200;
the env runs to its end (exit 0) posting through the capability URL, the trainer is served
every group the env had acknowledged (none twice); the token appears nowhere in the API's log
(debug level).

Where namespaces cannot be made (not root, no CAP_NET_ADMIN: ``ip netns add`` fails), the
test runs the same flow on loopback with the token set (the capability URL and atroposlib's
use of it are the same; what is lost is only the second address) and says so in its output;
the fail-closed start is checked on ``0.0.0.0`` there, which exits before binding.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bench.api.servers import ensure_atropos
from launch.procs import ManagedProcess, tail
from settings.ports import free_port

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent.resolve().parent
API_IP, ENV_IP = "10.250.0.1", "10.250.0.2"
BATCH, GROUP, TOTAL_STEPS = 8, 4, 3


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[tuple[list[str], list[str], str] | None]:
    """``(api_prefix, env_prefix, api_ip)``: command prefixes that run a program on the API's
    machine and on the env's (``ip netns exec NS``), or None where namespaces cannot be made."""
    tag = secrets.token_hex(3)
    api_ns, env_ns = f"sr1-api-{tag}", f"sr1-env-{tag}"
    made: list[str] = []
    try:
        if shutil.which("ip") is None:
            yield None
            return
        for ns in (api_ns, env_ns):
            if _ip("netns", "add", ns).returncode != 0:
                yield None
                return
            made.append(ns)
        steps = [
            ("link", "add", f"sr1a{tag}", "netns", api_ns, "type", "veth")
            + ("peer", "name", f"sr1e{tag}", "netns", env_ns),
            ("-n", api_ns, "addr", "add", f"{API_IP}/30", "dev", f"sr1a{tag}"),
            ("-n", env_ns, "addr", "add", f"{ENV_IP}/30", "dev", f"sr1e{tag}"),
            ("-n", api_ns, "link", "set", f"sr1a{tag}", "up"),
            ("-n", env_ns, "link", "set", f"sr1e{tag}", "up"),
            ("-n", api_ns, "link", "set", "lo", "up"),
            ("-n", env_ns, "link", "set", "lo", "up"),
        ]
        for step in steps:
            r = _ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr}"
        yield ["ip", "netns", "exec", api_ns], ["ip", "netns", "exec", env_ns], API_IP
    finally:
        for ns in made:  # takes the veth pair with it
            _ip("netns", "del", ns)


def _env_config(tmp: Path, rollout_url: str, openai_url: str, tokenizer: Path) -> Path:
    cfg = {
        "env": {
            "rollout_server_url": rollout_url,
            "tokenizer_name": str(tokenizer),
            "group_size": GROUP,
            "total_steps": TOTAL_STEPS,
            "use_wandb": False,
            "max_token_length": 64,
            "max_num_workers": 2,
            "wandb_name": "toy",
        },
        "openai": {
            "base_url": openai_url + "/v1",
            "api_key": "x",
            "model_name": "toy",
            "server_type": "openai",
        },
    }
    path = tmp / "env.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_atroposlib_env_reaches_a_token_protected_api_by_its_capability_url(
    hosts: tuple[list[str], list[str], str] | None, tmp_path: Path
) -> None:
    py = ensure_atropos()
    toy = str(HERE / "atropos_toy_env.py")
    if hosts is None:
        print("network namespaces unavailable here: the loopback fallback (module docstring)")
        on_api, on_env, ip = [], [], "127.0.0.1"
        port, oport, refused_host = free_port(), free_port(), "0.0.0.0"
    else:
        on_api, on_env, ip = hosts
        port, oport, refused_host = 8000, 9001, ip  # each namespace has its own ports
    token = secrets.token_urlsafe(24)
    base = {k: v for k, v in os.environ.items() if k != "SHOP_R1_API_TOKEN"}
    api_argv = [sys.executable, "-m", "api", "--port", str(port), "--log-level", "debug"]
    api_argv += ["--db-path", str(tmp_path / "api.sqlite")]

    # fail closed: that address without a token does not start
    refused = subprocess.run(
        [*on_api, *api_argv, "--host", refused_host],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1, refused.stderr
    assert f"refusing to serve on {refused_host!r} without a token" in refused.stderr
    assert "SHOP_R1_API_TOKEN" in refused.stderr and "--insecure-no-token" in refused.stderr

    url, cap = f"http://{ip}:{port}", f"http://{ip}:{port}/t/{token}"
    procs: list[ManagedProcess] = []
    try:
        api = ManagedProcess(
            "api",
            [*on_api, *api_argv, "--host", ip],
            tmp_path / "api.log",
            env={**base, "SHOP_R1_API_TOKEN": token},
        )
        procs.append(api.start())
        oai = ManagedProcess(
            "openai", [*on_env, str(py), toy, "openai-server", str(oport)], tmp_path / "oai.log"
        )
        procs.append(oai.start())
        probe = [*on_env, str(py), str(HERE / "net_probe.py"), f"{url}/health"]
        urls = [f"{url}/health", f"{url}/t/wrong/health", f"{cap}/health", f"{cap}/status"]
        seen = subprocess.run([*probe, *urls], capture_output=True, text=True, timeout=180)
        assert seen.returncode == 0, f"{seen.stderr}\n{tail(api.log_path)}"
        assert json.loads(seen.stdout) == dict(zip(urls, [401, 401, 200, 200], strict=True))

        out, stop = tmp_path / "served.json", tmp_path / "stop"
        trainer_argv = [str(py), str(HERE / "atropos_trainer.py"), cap, str(BATCH), str(out)]
        trainer_argv += [str(stop), sysconfig.get_paths()["purelib"]]
        trainer = ManagedProcess("trainer", [*on_env, *trainer_argv], tmp_path / "trainer.log")
        procs.append(trainer.start())
        records = tmp_path / "records"
        records.mkdir()
        tokenizer = tmp_path / "tok"
        subprocess.run([str(py), toy, "make-tokenizer", str(tokenizer)], check=True, timeout=300)
        cfg = _env_config(tmp_path, cap, f"http://127.0.0.1:{oport}", tokenizer)
        env = ManagedProcess(
            "env",
            [*on_env, str(py), toy, "serve", "--config", str(cfg)],
            tmp_path / "env.log",
            env={**base, "TOY_RECORD_DIR": str(records)},
        )
        procs.append(env.start())
        deadline = time.monotonic() + 600
        while env.alive() and time.monotonic() < deadline:
            for p in (api, oai, trainer):
                assert p.alive(), f"{p.name} died:\n{tail(p.log_path)}"
            time.sleep(1)
        assert not env.alive(), f"the env did not finish:\n{tail(env.log_path)}"
        assert env.popen.returncode == 0, f"the env failed:\n{tail(env.log_path)}"
        stop.touch()
        assert trainer.wait_exit() == 0, tail(trainer.log_path)
    finally:
        for p in reversed(procs):
            p.stop()

    batches = [r["batch"] for r in json.loads(out.read_text())["replies"]]
    served = Counter(g["group_overrides"]["toy_uid"] for b in batches for g in b)
    assert batches and max(served.values()) == 1, "a group was served twice"
    acked = {
        json.loads(line)["group"]["group_overrides"]["toy_uid"]
        for f in records.glob("env-*.jsonl")
        for line in f.read_text().splitlines()
        if json.loads(line)["event"] == "acked"
    }
    assert set(served) <= acked and len(acked - set(served)) < BATCH // GROUP
    log = (tmp_path / "api.log").read_text()
    assert "serving on" in log and token not in log, "the token is in the API's log"

"""``launch/run_all.sh``: the four services together (API -> vLLM -> env -> trainer), then
the SFT-vs-RL evaluation table, the reward curve and the run's page (report.html).

    launch/run_all.sh                                  # cpu-tiny, shared_vllm, 120 GRPO steps
    launch/run_all.sh --recipe recipes/tiny-qwen2/shop-r1/grpo.yaml   # preset < recipe < flags
    launch/run_all.sh --weight-bridge-mode none --training-steps 5 --run-dir runs/try
    launch/run_all.sh --num-inference-servers 2        # one trainer broadcast feeds both

Every process is a ``ManagedProcess`` (own process group, own log under the run dir) and is
stopped by its PID on Ctrl-C / SIGTERM, when a service dies, or when the trainer is done; if
the launcher itself dies (SIGKILL included), they die with it (``launch.lifeline``). Each
gets a share of the cores (``launch.threads``). Each service's config is resolved once (preset
< recipe < flags, ``launch.configs``) and handed to it as ``<run>/config/<service>.yaml``.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

from api.config import TOKEN_ENV as API_TOKEN_ENV
from api.config import ApiConfig, check_exposure
from launch import progress, verifiers_env
from launch.configs import resolve_for_run, write_service_configs
from launch.cost_probe import CostProbe
from launch.eval_table import eval_table
from launch.evaluation import evaluate, finish_evaluation, pages_table, start_evaluation
from launch.follow import LogSource, grpo_source
from launch.placement import (
    Placement,
    PlacementError,
    plan_placement,
    visible_gpus,
)
from launch.prepare import (
    context_warning,
    prepare_embedded,
    prepares_embedded,
    resume_plan,
    reused_sft_eval,
)
from launch.procs import ManagedProcess, tail
from launch.report import build_report
from launch.reward_curve import reward_curve
from launch.run_config import RunConfig, parse_args
from launch.supervisor import PY, ServiceFailed, Stack
from launch.threads import ThreadPlan, available_cores, plan_threads
from launch.trainer_node import launcher_argv, publish_trainer_argv
from launch.vllm_server import BridgeServer
from settings.bind import UnsafeBind, is_loopback
from settings.paths import RUNS_DIR
from settings.ports import free_port


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def vllm_names(n: int) -> list[str]:
    """Service names (= log names) of ``n`` vLLM servers: vllm, vllm1, vllm2, ..."""
    return ["vllm"] + [f"vllm{i}" for i in range(1, n)]


def placement(cfg: RunConfig) -> Placement:
    """Devices of every process (launch/placement.py); fails before anything starts."""
    lc = cfg.launch
    device = lc.trainer_device
    gpus = lc.gpus or None
    if device == "cuda" and gpus is None:
        gpus = visible_gpus()
    try:
        return plan_placement(
            device,
            cfg.weight_bridge_mode,
            cfg.single_copy,
            lc.num_inference_servers,
            lc.tensor_parallel_size,
            gpus or [],
            lc.trainer_procs,
        )
    except PlacementError as e:
        raise ServiceFailed(f"cannot place the processes of preset {cfg.preset}: {e}") from e


def vllm_extra(cfg: RunConfig) -> list[str]:
    """Flags every vLLM server gets after its config file (they win over it)."""
    extra: list[str] = []
    if cfg.verifiers is not None:  # verifiers' renderer samples from /inference/v1/generate
        extra.append("--enable-scale-out")
    if cfg.launch.tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(cfg.launch.tensor_parallel_size)]
    return extra + shlex.split(
        cfg.launch.vllm_args or ""
    )  # last: vLLM takes the last value of a flag


def trainer_env(place: Placement) -> dict[str, str]:
    """The trainer's environment: its own GPU(s) on CUDA; MASTER_ADDR/MASTER_PORT pass
    through (the broadcast rendezvous, trainer/bridge)."""
    env = dict(os.environ)
    if place.trainer_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(place.trainer_gpus)
    return env


def api_connect_host(host: str) -> str:
    """Where the run's own services reach the API bound to ``host``: loopback for a loopback
    or wildcard bind (``0.0.0.0``, ``::``), that address otherwise (IPv6 in brackets)."""
    if host in ("", "0.0.0.0", "::", "[::]") or is_loopback(host):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def api_token_env(api: ApiConfig) -> dict[str, str]:
    """The API's token for the processes that talk to it (the API itself, the env, the
    trainer), in their environment: run files never hold it (``launch.configs``), so a token
    given as ``--api.token`` reaches them only this way; none without one."""
    return {API_TOKEN_ENV: api.token} if api.token else {}


def wait_api(proc: ManagedProcess, url: str, token: str | None, timeout: float) -> None:
    """Wait until the API answers ``GET url/health`` 200, the token (if any) in a header: never
    in a URL, which error messages print."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise ServiceFailed(
                f"api exited before {url}/health answered; read {proc.log_path}:\n"
                f"{tail(proc.log_path)}"
            )
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServiceFailed(f"api did not answer {url}/health within {timeout:.0f}s")
        time.sleep(0.2)


def trainer_launcher(cfg: RunConfig, environ: dict[str, str] | None = None) -> list[str]:
    """``python``, or torchrun for ``--trainer-procs N`` / several nodes (launch/trainer_node.py)."""
    try:
        return launcher_argv(
            PY, cfg.launch.trainer_procs, os.environ if environ is None else environ
        )
    except ValueError as e:
        raise ServiceFailed(str(e)) from e


def trainer_argv(cfg: RunConfig, config: Path, token: str) -> list[str]:
    """``python -m trainer grpo --config <run>/config/trainer_grpo.yaml`` (under torchrun for
    several ranks); the bridge token on the command line, never in the file."""
    return [
        *trainer_launcher(cfg),
        "-m",
        "trainer",
        "grpo",
        "--config",
        str(config),
        "--bridge-token",
        token,
    ]


def start_vllm_servers(
    cfg: RunConfig,
    ports: list[int],
    config: Path,
    place: Placement,
    model: str,
    token: str,
    stack: Stack,
    run_dir: Path,
    threads: ThreadPlan | None = None,
) -> list[BridgeServer]:
    """Start every vLLM server side by side (recorded in the stack at once), then wait for
    each health check."""
    from launch.vllm_server import server_env, spawn_bridge_server

    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    servers = []
    for i, name in enumerate(vllm_names(cfg.launch.num_inference_servers)):
        port = ports[i]
        env = server_env(token, device, place.server_gpus[i])
        env.update(threads.for_server(i) if threads else {})
        server = spawn_bridge_server(
            model,
            cfg.weight_bridge_mode,
            run_dir / f"{name}.log",
            token=token,
            single_copy=cfg.single_copy,
            extra=["--config", str(config), *vllm_extra(cfg)],
            port=port,
            timeout=cfg.launch.health_timeout,
            env=env,
            name=name,
        )
        stack.add(server.proc)
        servers.append(server)
    for server, gpu_ids in zip(servers, place.server_gpus, strict=True):
        try:
            server.wait(cfg.launch.health_timeout)
        except (RuntimeError, TimeoutError) as e:
            raise ServiceFailed(f"{server.proc.name} did not come up: {e}") from e
        gpus = f" on GPU {','.join(gpu_ids)}" if gpu_ids else ""
        print(
            f"[run_all] {server.proc.name} up at {server.base_url}{gpus} (pid {server.proc.pid})",
            flush=True,
        )
    return servers


def weight_versions(servers: list[BridgeServer]) -> dict[str, str | None]:
    """Each server's current weight version (its /bridge/health), by service name."""
    out: dict[str, str | None] = {}
    for s in servers:
        try:
            health = httpx.get(f"{s.base_url}/bridge/health", timeout=10).json()
            out[s.proc.name] = health.get("weight_version")
        except (httpx.HTTPError, ValueError):
            out[s.proc.name] = None
    return out


def launch(argv: list[str], cfg: RunConfig, stack: Stack, run_dir: Path) -> int:
    lc = cfg.launch
    place = placement(cfg)
    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    threads = plan_threads(available_cores(), lc.num_inference_servers, device)
    light = {**os.environ, **threads.light_env}
    api_url = f"http://{api_connect_host(cfg.api.host)}:{lc.api_port or free_port()}"
    ports = [lc.vllm_port or free_port()]
    ports += [free_port() for _ in range(lc.num_inference_servers - 1)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    # the run's config resolved once, with the launcher's decisions, before anything starts
    cfg = resolve_for_run(argv, api_url, urls, run_dir, place.trainer_device)
    model, save = str(cfg.model), Path(cfg.trainer.grpo.save_path)
    env_cfg, steps = cfg.env, cfg.trainer.grpo.training_steps
    probe = CostProbe(cfg, argv, threads.trainer_env)  # the trainer's threads
    if prepares_embedded(cfg):
        prepare_embedded(cfg, run_dir, before_sft=probe.before_sft)
    budget = (env_cfg.max_prompt_tokens, env_cfg.max_tokens)
    envs = (["env"] if lc.shop_r1_env else []) + (["verifiers"] if cfg.verifiers else [])
    if not envs:
        why = "launch.shop_r1_env is false and the run has no verifiers: section"
        raise ServiceFailed(f"no environment to train on: {why}")
    if lc.shop_r1_env and (warning := context_warning(model, *budget)) is not None:
        print(f"[run_all] WARNING: {warning}", flush=True)
    if lc.prepare_only:
        print(f"[run_all] prepared {model}", flush=True)
        return 0
    files = write_service_configs(run_dir, cfg)
    print(
        f"[run_all] configs: {run_dir / 'config'} (preset {cfg.preset}"
        f"{f', recipe {cfg.recipe}' if cfg.recipe else ''})",
        flush=True,
    )
    token = secrets.token_hex(16)
    names = ["api", *vllm_names(lc.num_inference_servers), *envs, "trainer"]
    logs = " ".join(str(run_dir / f"{n}.log") for n in names)
    print(f"[run_all] run dir {run_dir}\n[run_all] follow it: tail -f {logs}", flush=True)
    print(f"[run_all] {threads.describe()} (launch/threads.py)", flush=True)

    vllm_log = LogSource(run_dir / "vllm.log")  # what the first server is doing
    services = progress.phase("start API + vLLM", 1 + lc.num_inference_servers, "up", vllm_log)
    services.start()
    light |= api_token_env(cfg.api)  # the API, the env and the trainer: one token
    api = stack.start("api", [PY, "-m", "api", "--config", str(files["api"])], light)
    wait_api(api, api_url, cfg.api.token, 60)
    where = "" if not cfg.api.token else " (token required; clients without a header: /t/<token>/)"
    print(f"[run_all] api up at {api_url}{where} (pid {api.pid})", flush=True)
    services.advance()

    print(
        f"[run_all] starting {lc.num_inference_servers} vLLM server(s) "
        f"({cfg.weight_bridge_mode}{', single copy' if cfg.single_copy else ''}) on {model}...",
        flush=True,
    )
    samples = lc.eval_samples if lc.shop_r1_env else 0  # Shop-R1's test rows
    done = reused_sft_eval(cfg, run_dir)
    sft_eval = None
    if samples and done is None:  # it loads while vLLM starts, then waits for its /health
        sft_eval = start_evaluation(  # the evaluations ask the first server
            "sft", urls[0], samples, run_dir, files["env"], lc.health_timeout
        )
    try:
        servers = start_vllm_servers(
            cfg, ports, files["vllm"], place, model, token, stack, run_dir, threads
        )
    except BaseException:
        if sft_eval is not None:
            sft_eval.stop()
        raise
    services.advance(len(servers))
    services.finish()
    server = servers[0]  # the evaluations ask the first one

    if done is not None:
        print(f"[run_all] SFT evaluation: reusing {done} (--resume)", flush=True)
        sft_metrics = json.loads(done.read_text())
    else:
        sft_metrics = finish_evaluation(sft_eval) if sft_eval is not None else None

    probe.before_grpo()  # what GRPO's trainer will cost here, while vLLM idles (cost_probe)
    held_out = verifiers_env.evaluate_before(cfg, urls[0], run_dir, light)
    if lc.shop_r1_env:
        stack.start("env", [PY, "-m", "env_server", "--config", str(files["env"])], light)
    if cfg.verifiers is not None:
        stack.start("verifiers", verifiers_env.service_argv(files["verifiers"]), light)
    argv = trainer_argv(cfg, files["trainer_grpo"], token)
    if int(os.environ.get("NNODES") or 1) > 1:  # the other nodes' ranks (launch/trainer_node.py)
        publish_trainer_argv(run_dir, argv)
    trainer_vars = {**trainer_env(place), **threads.trainer_env, **api_token_env(cfg.api)}
    trainer = stack.start("trainer", argv, env=trainer_vars)
    where = f" on GPU {','.join(place.trainer_gpus)}" if place.trainer_gpus else ""
    print(
        f"[run_all] {' + '.join(envs)} + trainer{where} started; training {steps} steps", flush=True
    )
    with progress.phase("GRPO", steps, "steps", grpo_source(save, steps)):
        while trainer.alive():
            stack.check_alive("api", *vllm_names(lc.num_inference_servers), *envs)
            time.sleep(1.0)
    if trainer.popen.returncode != 0:  # why (an OOM kill, a full disk) and the figures
        raise ServiceFailed(stack.died(trainer))
    for name in envs:  # no more rollouts: vLLM now serves the trainer's final weights
        stack.stop(name)
    versions = weight_versions(servers)
    (run_dir / "weight_versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(
        f"[run_all] trainer done; final model in {save}; weight version per server: {versions}",
        flush=True,
    )

    reward_curve(save / "metrics.jsonl", run_dir / "reward_curve.png")
    if sft_metrics is not None:
        health = httpx.get(f"{server.base_url}/bridge/health", timeout=10).json()
        rl_metrics = evaluate("rl", server.base_url, samples, run_dir, files["env"])
        note = (
            f"{samples} test steps, greedy. SFT = {model}; RL = the trainer's final "
            f"weights ({save}) as served by vLLM after the last sync "
            f"(weight version {health.get('weight_version')}, mode {cfg.weight_bridge_mode})."
        )
        table = eval_table(sft_metrics, rl_metrics, note)
        table += "\nPer page kind (`python -m env_server.page_report`):\n\n"
        table += pages_table(run_dir, samples, env_cfg) + "\n"
        (run_dir / "eval.md").write_text(table)
        print(table, flush=True)
    if held_out is not None:
        verifiers_env.report_after(cfg, server.base_url, run_dir, light, held_out)
    print(f"[run_all] reward curve: {run_dir / 'reward_curve.png'}", flush=True)
    print(f"[run_all] the run's page: {build_report(run_dir)} (open it in a browser)", flush=True)
    return 0


def resume_hint(run_dir: Path, argv: list[str]) -> str:
    """How to continue this run: the same flags with ``--resume``, and what that will do from
    the state the run is in now (``launch.prepare.resume_plan``: the command resolved as its
    launch will resolve it, against the files the stopped run left)."""
    valued = ("--run-dir", "--launch.run-dir")  # either spelling: the hint gives its own
    flags = ("--resume", "--no-resume", "--launch.resume", "--no-launch.resume")
    rest, skip = [], False
    for a in argv:
        if skip or a in valued or a in flags or a.startswith(tuple(f"{v}=" for v in valued)):
            skip = a in valued
            continue
        rest.append(a)
    args = ["--resume", "--run-dir", str(run_dir), *rest]
    cmd = shlex.join(["launch/run_all.sh", *args])
    try:
        url = "http://127.0.0.1:0"  # the run's ports and URLs decide nothing of it
        what = resume_plan(resolve_for_run(args, url, [url], run_dir, warn=False), run_dir)
    except Exception as e:  # noqa: BLE001 -- the hint must never hide why the run stopped
        what = f"what it will redo could not be worked out: {type(e).__name__}: {e}"
    return f"[run_all] to continue this run: {cmd}\n[run_all]   --resume: {what}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    lc = cfg.launch
    if lc.resume and (lc.run_dir is None or not lc.run_dir.is_dir()):
        print(
            f"[run_all] FAILED: --resume continues a run: give its --run-dir "
            f"({lc.run_dir or 'none given'} is not a directory)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:  # fail closed before anything starts: an exposed API needs a token (settings/bind.py)
        insecure = check_exposure(cfg.api)
    except UnsafeBind as e:
        print(f"[run_all] FAILED: {e.code} (--api.token or ${API_TOKEN_ENV})", file=sys.stderr)
        return 2
    if insecure:
        print(f"[run_all] WARNING: {insecure}", file=sys.stderr, flush=True)
    run_dir = lc.run_dir or RUNS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    hint_argv, hint = argv, False
    stack = Stack(run_dir)
    # Ctrl-C and SIGTERM stop exactly what was started. SIGINT explicitly too: Python only
    # raises KeyboardInterrupt when SIGINT was not ignored at its start, and a parent that
    # ignores it (a pytest-xdist worker, `cmd &` in a script) would leave it ignored.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with progress.session():
            return launch(argv, cfg, stack, run_dir)
    except ServiceFailed as e:
        print(f"[run_all] FAILED: {e}", file=sys.stderr, flush=True)
        hint = not lc.prepare_only
        return 1
    except KeyboardInterrupt:
        print("[run_all] interrupted; stopping the services", file=sys.stderr, flush=True)
        hint = True
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the shutdown finish
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop_all()
        print(f"[run_all] stopped {[p.pid for p in stack.procs]}", flush=True)
        if hint:  # once everything stopped: no trainer writes a checkpoint after it is read
            print(resume_hint(run_dir, hint_argv), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

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
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from api.client import bearer
from api.config import TOKEN_ENV as API_TOKEN_ENV
from api.config import check_exposure
from launch import progress, verifiers_env
from launch.configs import launcher_config, write_service_configs
from launch.cost_estimate import LongRun
from launch.cost_probe import CostProbe
from launch.evaluation import (
    eval_samples,
    evaluate,
    evaluate_rl,
    evaluation_argv,
    evaluation_server,
    finish_evaluation,
    start_evaluation,
)
from launch.follow import LogSource, grpo_source
from launch.forked import forking
from launch.prepare import (
    context_warning,
    prepare_embedded,
    prepares_embedded,
    resume_hint,
    reused_sft_eval,
)
from launch.procs import ManagedProcess
from launch.report import build_report
from launch.reward_curve import reward_curve
from launch.run_config import RunConfig, parse_run
from launch.run_plan import (
    RunPlan,
    environments,
    own_eval_server,
    packing_note,
    plan_run,
    reproducible_note,
    trainer_argv,
    vllm_extra,
    with_precision,
)
from launch.supervisor import PY, ServiceFailed, Stack, wait_http
from launch.trainer_node import publish_trainer_argv
from launch.vllm_server import BridgeServer
from settings.bind import UnsafeBind
from settings.paths import RUNS_DIR


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def wait_api(proc: ManagedProcess, url: str, token: str | None, timeout: float) -> None:
    """Wait until the API answers ``GET url/health`` 200, the token (if any) in a header."""
    wait_http(proc, f"{url}/health", timeout, headers=bearer(token))


def start_vllm_servers(
    cfg: RunConfig, plan: RunPlan, config: Path, stack: Stack
) -> list[BridgeServer]:
    """Start every vLLM server side by side (recorded in the stack at once), then wait for
    each health check."""
    from launch.vllm_server import server_env, spawn_bridge_server

    servers = []
    for i, (name, port) in enumerate(zip(plan.vllm_names, plan.vllm_ports, strict=True)):
        env = server_env(plan.bridge_token, plan.device, plan.place.server_gpus[i])
        env.update(plan.threads.for_server(i))
        server = spawn_bridge_server(
            str(cfg.model),
            cfg.weight_bridge_mode,
            plan.run_dir / f"{name}.log",
            token=plan.bridge_token,
            single_copy=cfg.single_copy,
            extra=["--config", str(config), *vllm_extra(cfg)],
            port=port,
            timeout=cfg.launch.health_timeout,
            env=env,
            name=name,
        )
        stack.add(server.proc)
        servers.append(server)
    for server, gpu_ids in zip(servers, plan.place.server_gpus, strict=True):
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


def say(line: str) -> None:
    print(f"[run_all] {line}", flush=True)


def prepare(cfg: RunConfig, plan: RunPlan, probe: CostProbe) -> list[str]:
    """Build what the run needs and is missing (model, dataset, SFT cold start); the
    environments it trains on."""
    if prepares_embedded(cfg):
        prepare_embedded(cfg, plan.run_dir, before_sft=probe.before_sft)
    envs = environments(cfg)
    budget = (cfg.env.max_prompt_tokens, cfg.env.max_tokens)
    if cfg.launch.shop_r1_env and (warning := context_warning(str(cfg.model), *budget)) is not None:
        say(f"WARNING: {warning}")
    return envs


def write_configs(cfg: RunConfig, plan: RunPlan, envs: list[str]) -> dict[str, Path]:
    """Each service's file under ``<run>/config/``; where to follow the run."""
    files = write_service_configs(plan.run_dir, cfg)
    recipe = f", recipe {cfg.recipe}" if cfg.recipe else ""
    say(f"configs: {plan.run_dir / 'config'} (preset {cfg.preset}{recipe})")
    say(
        f"run dir {plan.run_dir}\n[run_all] follow it: tail -f {' '.join(map(str, plan.logs(envs)))}"
    )
    say(f"{plan.threads.describe()} (launch/threads.py)")
    how = "as forks of one template process that imported vLLM once" if plan.forked else "plainly"
    say(f"services start {how} (launch/forked.py; --fork-services / --no-fork-services)")
    return files


def start_api(cfg: RunConfig, plan: RunPlan, files: dict[str, Path], stack: Stack) -> None:
    api_cmd = [PY, "-m", "api", "--config", str(files["api"])]
    api = stack.start("api", api_cmd, plan.light_env(cfg))
    wait_api(api, plan.api_url, cfg.api.token, 60)
    where = "" if not cfg.api.token else " (token required; clients without a header: /t/<token>/)"
    say(f"api up at {plan.api_url}{where} (pid {api.pid})")


def start_inference(
    cfg: RunConfig, plan: RunPlan, files: dict[str, Path], stack: Stack
) -> tuple[list[BridgeServer], dict[str, Any] | None, Path | None]:
    """The vLLM servers, and the start weights' evaluations on the first one: the SFT
    model's on Shop-R1, the verifiers env's held-out tasks. Each loads while vLLM starts,
    then waits for its /health; ``--resume`` reuses a finished one. Returns the servers, the
    SFT evaluation's metrics and the verifiers evaluation's file (None where not run)."""
    single = ", single copy" if cfg.single_copy else ""
    say(
        f"starting {len(plan.vllm_ports)} vLLM server(s) ({cfg.weight_bridge_mode}{single}) "
        f"on {cfg.model}..."
    )
    samples = eval_samples(cfg)
    done = reused_sft_eval(cfg, plan.run_dir, plan.eval_dtype)
    url, run_dir, timeout = plan.vllm_urls[0], plan.run_dir, cfg.launch.health_timeout
    split = cfg.launch.eval_split
    sft_eval: ManagedProcess | dict[str, Any] | None = None
    if samples and done is None and own_eval_server(cfg, plan.device):  # first, with every core
        with evaluation_server(cfg, plan, files["vllm"], stack, cfg.model, "sft") as eval_url:
            sft_eval = evaluate(
                "sft", eval_url, samples, run_dir, files["env"], split, plan.eval_dtype
            )
    elif samples and done is None:  # while the run's servers start, on the first one
        argv = evaluation_argv("sft", url, samples, run_dir, files["env"], timeout, split)
        sft_eval = start_evaluation("sft", run_dir, argv)
    held_out = None
    try:
        held_out = verifiers_env.start_before(cfg, url, run_dir, plan.light_env(cfg), timeout)
        servers = start_vllm_servers(cfg, plan, files["vllm"], stack)
    except BaseException:
        for proc in (sft_eval, held_out):
            if isinstance(proc, ManagedProcess):
                proc.stop()
        raise
    if isinstance(held_out, ManagedProcess):
        held_out = verifiers_env.finish_evaluation(held_out)
    if done is not None:
        say(f"SFT evaluation: reusing {done} (--resume)")
        return servers, json.loads(done.read_text()), held_out
    if isinstance(sft_eval, ManagedProcess):
        sft_eval = finish_evaluation(sft_eval)
    return servers, sft_eval, held_out


def train(
    cfg: RunConfig, plan: RunPlan, files: dict[str, Path], envs: list[str], stack: Stack
) -> None:
    """The environments and the trainer, until the trainer is done (a service that dies
    stops the run)."""
    light = plan.light_env(cfg)
    if cfg.launch.shop_r1_env:
        stack.start("env", [PY, "-m", "env_server", "--config", str(files["env"])], light)
    if cfg.verifiers is not None:
        stack.start("verifiers", verifiers_env.service_argv(files["verifiers"]), light)
    trainer_cmd = trainer_argv(cfg, files["trainer_grpo"], plan.bridge_token)
    if int(os.environ.get("NNODES") or 1) > 1:  # the other nodes' ranks (launch/trainer_node.py)
        publish_trainer_argv(plan.run_dir, trainer_cmd)
    trainer = stack.start("trainer", trainer_cmd, env=plan.trainer_env(cfg))
    gpus = plan.place.trainer_gpus
    steps, save = cfg.trainer.grpo.training_steps, Path(cfg.trainer.grpo.save_path)
    where = f" on GPU {','.join(gpus)}" if gpus else ""
    say(f"{' + '.join(envs)} + trainer{where} started; training {steps} steps")
    with progress.phase("GRPO", steps, "steps", grpo_source(save, steps)):
        while trainer.alive():
            stack.check_alive("api", *plan.vllm_names, *envs)
            time.sleep(1.0)
    if trainer.popen.returncode != 0:  # why (an OOM kill, a full disk) and the figures
        raise ServiceFailed(stack.died(trainer))
    for name in envs:  # no more rollouts: vLLM now serves the trainer's final weights
        stack.stop(name)


def launch(cfg: RunConfig, plan: RunPlan, stack: Stack, argv: list[str]) -> int:
    """The run ``cfg`` (resolved with the launcher's decisions, ``plan``), phase by phase;
    ``argv``: the command line, for the cost probe's advice."""
    if plan.precision is not None:  # before SFT, which computes in it too
        say(
            f"trainers compute in {plan.precision}: --precision auto resolved once here, for "
            "the trainers and the evaluations' dtype (trainer/precision.py)"
        )
    probe = CostProbe(cfg, argv, plan.threads.trainer_env, run_dir=plan.run_dir)
    envs = prepare(cfg, plan, probe)
    if cfg.launch.prepare_only:
        say(f"prepared {cfg.model}")
        return 0
    files = write_configs(cfg, plan, envs)
    vllm_log = LogSource(plan.run_dir / "vllm.log")  # what the first server is doing
    services = progress.phase("start API + vLLM", 1 + len(plan.vllm_ports), "up", vllm_log)
    services.start()
    start_api(cfg, plan, files, stack)
    services.advance()
    servers, sft_metrics, held_out = start_inference(cfg, plan, files, stack)
    services.advance(len(servers))
    services.finish()
    probe.before_grpo()  # what GRPO's trainer will cost here, while vLLM idles (cost_probe)
    light = plan.light_env(cfg)
    train(cfg, plan, files, envs, stack)
    versions = weight_versions(servers)
    (plan.run_dir / "weight_versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    save = Path(cfg.trainer.grpo.save_path)
    say(
        f"trainer done; checkpoints in {save / 'checkpoints'}; weight version per server: {versions}"
    )
    reward_curve(save / "metrics.jsonl", plan.run_dir / "reward_curve.png")
    if sft_metrics is not None:  # the RL evaluation (launch.eval_server: which server)
        evaluate_rl(cfg, plan, servers[0], files, stack, sft_metrics)
    if held_out is not None:
        verifiers_env.report_after(cfg, servers[0].base_url, plan.run_dir, light, held_out)
    say(f"reward curve: {plan.run_dir / 'reward_curve.png'}")
    say(f"the run's page: {build_report(plan.run_dir)} (open it in a browser)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The services write their bytecode caches even where the environment says not to
    # (PYTHONDONTWRITEBYTECODE=1, as some sandboxes set): the install compiles none (Makefile),
    # so the first process that imports a module writes its .pyc and the rest read it.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    layers, asked = parse_run(argv)  # the run the user asked for
    lc = asked.launch
    if lc.resume and (lc.run_dir is None or not lc.run_dir.is_dir()):
        print(
            f"[run_all] FAILED: --resume continues a run: give its --run-dir "
            f"({lc.run_dir or 'none given'} is not a directory)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:  # fail closed before anything starts: an exposed API needs a token (settings/bind.py)
        insecure = check_exposure(asked.api)
    except UnsafeBind as e:
        print(f"[run_all] FAILED: {e.code} (--api.token or ${API_TOKEN_ENV})", file=sys.stderr)
        return 2
    if insecure:
        print(f"[run_all] WARNING: {insecure}", file=sys.stderr, flush=True)
    for note in (packing_note(asked), reproducible_note(asked)):
        if note:
            print(f"[run_all] NOTE: {note}", flush=True)
    run_dir = lc.run_dir or RUNS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    hint, tiny = False, None
    stack = Stack(run_dir)
    # Ctrl-C and SIGTERM stop exactly what was started. SIGINT explicitly too: Python only
    # raises KeyboardInterrupt when SIGINT was not ignored at its start, and a parent that
    # ignores it (a pytest-xdist worker, `cmd &` in a script) would leave it ignored.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with progress.session():
            plan = plan_run(asked, run_dir)
            # the run's config, resolved once with the launcher's decisions, before anything starts
            cfg = launcher_config(
                layers, asked, plan.api_url, plan.vllm_urls, run_dir, plan.place.trainer_device
            )
            cfg = with_precision(cfg, plan.precision)  # one resolution of `auto` for all
            with forking(plan.forked):  # the services' start (launch/forked.py)
                return launch(cfg, plan, stack, argv)
    except ServiceFailed as e:
        print(f"[run_all] FAILED: {e}", file=sys.stderr, flush=True)
        hint = not lc.prepare_only
        return 1
    except LongRun as e:  # --long-run tiny: nothing was trained; the tiny preset instead
        tiny = [*e.argv, "--run-dir", str(run_dir)]
    except KeyboardInterrupt:
        print("[run_all] interrupted; stopping the services", file=sys.stderr, flush=True)
        hint = True
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the shutdown finish
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop_all()
        if stack.procs:  # nothing started (--long-run tiny before training): nothing to say
            print(f"[run_all] stopped {[p.pid for p in stack.procs]}", flush=True)
        if hint:  # once everything stopped: no trainer writes a checkpoint after it is read
            print(resume_hint(run_dir, argv), file=sys.stderr, flush=True)
    assert tiny is not None  # only a LongRun gets here
    print(f"[run_all] running: {shlex.join(['launch/run_all.sh', *tiny])}", flush=True)
    return main(tiny)


if __name__ == "__main__":
    sys.exit(main())

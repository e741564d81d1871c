"""``python -m vllm_patching.serve [--config FILE] --model PATH [vLLM args]
--weight-bridge-mode ...``

Runs vLLM's own OpenAI server (in this process) with the bridge plugin enabled: parses the
bridge flags, passes every other flag to vLLM, sets the environment the plugin reads, writes
the per-run bridge config file, then hands over to ``vllm.entrypoints.openai.api_server``.
``--config FILE`` (alias ``--recipe``): a run file's ``vllm:`` options become arguments placed
before the command line's, so a flag wins over the file (docs/RECIPES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
import time
import typing
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from settings.bind import check_bind
from settings.ports import VLLM_PORT
from vllm_patching import startup_signals
from vllm_patching.config import VllmConfig
from vllm_patching.protocol import (
    PLUGIN_NAME,
    SETTINGS_ENV,
    TOKEN_ENV,
    BridgeConfigFile,
    BridgeSettings,
)

BACKENDS = {  # (device, single_copy) -> vLLM weight-transfer backend of shared_vllm
    ("cpu", False): "gloo_bcast",
    ("cpu", True): "shm",
    ("cuda", False): "nccl",
    ("cuda", True): "ipc",
}


BRIDGE_DEFAULTS: dict[str, Any] = {
    "weight_bridge_mode": "shared_vllm",
    "single_copy": False,
    "bridge_config": None,
    "bridge_initial_version": 0,
    "bridge_lora_keep": 2,
    "bridge_device": "auto",
    "insecure_no_token": False,
}
"""This wrapper's own options (``vllm:`` keys typed and documented by ``VllmConfig``) and
their defaults; every other key goes to vLLM."""


def file_argv(path: Path) -> list[str]:
    """A run file's ``vllm:`` options (its ``base:`` chain and shortcuts applied, typed by
    ``VllmConfig``; a wrong value names the key) as arguments."""
    from settings.cli import resolve_section

    vllm = resolve_section(VllmConfig, "vllm", [path], environ={})
    return mapping_argv(vllm.model_dump(mode="json", exclude_none=True))


def mapping_argv(values: Mapping[str, Any]) -> list[str]:
    """``{key: value}`` as arguments: ``--key value``, true ``--key``, false ``--no-key`` (a
    bridge option: omitted), a list ``--key a b``, a mapping ``--key '<json>'``."""
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or value is False and key not in BRIDGE_DEFAULTS:  # bridge: store_true
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None and not isinstance(value, bool):
            value = json.dumps(value) if isinstance(value, dict) else value
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def expand_files(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config FILE`` (alias ``--recipe``) taken out and the files'
    arguments put first, in order: a later file, then any argument of the command line, wins
    wherever it stands (vLLM's parser and ours keep the last value of an option)."""
    files: list[str] = []
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name not in ("--config", "--recipe"):
            rest.append(arg)
        elif (path := value if eq else next(args, None)) is None:
            raise SystemExit(f"{PROG}: {name} needs a FILE")
        else:
            files += file_argv(Path(path))
    return files + rest


PROG = "python -m vllm_patching.serve"
HELP_FLAGS = ("-h", "--help")


def bridge_parser() -> argparse.ArgumentParser:
    """The bridge's own options (every other argument goes to vLLM)."""
    p = argparse.ArgumentParser(
        PROG,
        usage=f"{PROG} [--config FILE] --model PATH [bridge options] [vLLM options]",
        description=__doc__,
        allow_abbrev=False,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for key, default in BRIDGE_DEFAULTS.items():
        info = VllmConfig.model_fields[key]
        flag = "--" + key.replace("_", "-")
        doc = f"{info.description}" + ("" if default is None else f" (default: {default})")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=doc)
            continue
        choices = typing.get_args(typing.get_args(info.annotation)[0]) or None  # a Literal's
        kind = int if isinstance(default, int) else str
        p.add_argument(flag, type=kind, default=default, choices=choices, help=doc)
    return p


def print_help(argv: list[str]) -> int:
    """The bridge's options, then vLLM's own ``--help`` (the help flags of ``argv`` passed on,
    e.g. ``--help=ModelConfig`` for one group's details). Starts nothing."""
    p = bridge_parser()
    p.add_argument(
        "-h",
        "--help",
        action="store_true",
        help="this help, then vLLM's (--help=GROUP: one group of vLLM's in full)",
    )
    p.add_argument(
        "--config",
        "--recipe",
        metavar="FILE",
        help="a run file's vllm: section as arguments before the command line's (flags win)",
    )
    p.add_argument("--model", metavar="PATH", help="model directory or hub id (required)")
    print(p.format_help())
    print("vLLM's options (every argument not listed above goes to vLLM's OpenAI server):\n")
    sys.stdout.flush()
    asked = [a for a in argv if a in HELP_FLAGS or a.startswith("--help=")]
    sys.argv = [PROG, *asked]
    try:
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # argparse exits after printing the help
        return e.code if isinstance(e.code, int) else 0
    return 0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = bridge_parser()
    args, rest = p.parse_known_args(argv)
    if args.single_copy and args.weight_bridge_mode != "shared_vllm":
        p.error("--single-copy only applies to --weight-bridge-mode shared_vllm")
    try:
        VllmConfig.model_validate({key: getattr(args, key) for key in BRIDGE_DEFAULTS})
    except ValidationError as e:
        p.error(str(e))
    return args, rest


def _flag(args: list[str], name: str) -> str | None:
    """Value of the last ``--name X`` / ``--name=X`` in a vLLM argv (the one vLLM takes)."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def _switch(args: list[str], name: str) -> bool | None:
    """The last of ``--name`` / ``--no-name`` in a vLLM argv (the one vLLM takes), else None."""
    found = None
    for a in args:
        if a in (name, "--no-" + name[2:]):
            found = a == name
    return found


def _detect_device() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else "cpu"


def check_access(
    vllm_args: list[str], insecure_no_token: bool, environ: Mapping[str, str] | None = None
) -> str | None:
    """Fail closed (settings/bind.py): exits (status 1, the fix in the message) when the server
    would listen on a non-loopback ``--host`` without the token and without
    ``--insecure-no-token``; returns the INSECURE warning to print under the opt-out. A Unix
    socket (``--uds``) is not checked: its file's permissions guard it."""
    environ = os.environ if environ is None else environ
    if _flag(vllm_args, "--uds") is not None:
        return None
    host = _flag(vllm_args, "--host")  # "" is every interface to vLLM, as 0.0.0.0
    host = "127.0.0.1" if host is None else host
    how = f"{TOKEN_ENV}=<secret> in the server's environment, the trainer's --bridge-token"
    return check_bind("the vLLM server", host, bool(environ.get(TOKEN_ENV)), insecure_no_token, how)


def check_pickles(backend: str | None, environ: Mapping[str, str] | None = None) -> None:
    """``--single-copy`` on CUDA (vLLM's ``ipc`` engine) sets
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: the server then unpickles what a weight route is
    sent, and a pickle is code. Such a server refuses to start without the token, whatever the
    address (loopback is open to every local user) and whatever ``--insecure-no-token`` says:
    with it, only a token holder reaches those routes."""
    environ = os.environ if environ is None else environ
    if backend == "ipc" and not environ.get(TOKEN_ENV):
        raise SystemExit(
            f"{PROG}: --single-copy on CUDA (vLLM's ipc engine) accepts pickled IPC handles "
            f"(VLLM_ALLOW_INSECURE_SERIALIZATION=1), so it needs a token on any address: set "
            f"{TOKEN_ENV}=<secret> in the server's environment and give the trainer the same "
            f"one (--bridge-token). --insecure-no-token does not lift this."
        )


def build(
    argv: list[str], environ: Mapping[str, str] | None = None
) -> tuple[BridgeSettings, list[str], dict[str, str]]:
    """Bridge settings, the vLLM argv and the environment to add (no side effects; exits on a
    bind or a transport that needs the token when ``environ`` (default ``os.environ``) has
    none: ``check_access``, ``check_pickles``)."""
    args, vllm_args = parse_args(expand_files(argv))
    model = _flag(vllm_args, "--model")
    if model is None:
        raise SystemExit(f"{PROG}: --model is required (--help lists the options)")
    vllm_args = list(vllm_args)
    if _flag(vllm_args, "--host") is None:
        vllm_args += ["--host", "127.0.0.1"]  # never listen on all interfaces by default
    if _flag(vllm_args, "--port") is None:  # the project's port, not vLLM's 8000 (the API's)
        vllm_args += ["--port", str(VLLM_PORT)]
    check_access(vllm_args, args.insecure_no_token, environ)  # before vLLM is imported
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # the native RL weight routes (guarded by our token)
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    env["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*plugins, PLUGIN_NAME]))
    device = _detect_device() if args.bridge_device == "auto" else args.bridge_device
    backend = None
    if args.weight_bridge_mode == "shared_vllm":
        backend = BACKENDS[(device, args.single_copy)]
        vllm_args += ["--weight-transfer-config", json.dumps({"backend": backend})]
        if backend == "ipc":
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # IPC handles travel pickled
    check_pickles(backend, environ)
    if args.weight_bridge_mode == "lora_only":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if "--enable-lora" not in vllm_args:
            vllm_args.append("--enable-lora")
    if _flag(vllm_args, "--logprobs-mode") is None:
        # Rollout logprobs are the "old" policy of the trainer's importance ratio, so they
        # must come from the distribution the tokens were sampled from: after temperature
        # (and top-p/top-k). vLLM's default returns the raw model's logprobs, which differ
        # from it whenever temperature != 1.
        vllm_args += ["--logprobs-mode", "processed_logprobs"]
    if _switch(vllm_args, "--enforce-eager"):
        # Eager means nothing compiled: vLLM still wraps its logprob-rank helper
        # (``batched_count_greater_than``, an integer count) in ``torch.compile``, and each
        # server traced and compiled it (inductor, a C++ build on the first) at its first
        # logprobs request: ~5 CPU-s a server on the CPU. Eager gives the same counts.
        env["TORCHDYNAMO_DISABLE"] = "1"
    if _flag(vllm_args, "--worker-extension-cls") is None:
        vllm_args += ["--worker-extension-cls", "vllm_patching.worker_ext.BridgeWorkerExtension"]
    run_id = uuid.uuid4().hex[:12]
    config_path = args.bridge_config or str(
        Path(tempfile.gettempdir()) / "shop_r1_bridge" / run_id / "vllm_bridge_config.json"
    )
    settings = BridgeSettings(
        mode=args.weight_bridge_mode,
        single_copy=args.single_copy,
        backend=backend,
        device=device,  # type: ignore[arg-type]
        initial_version=args.bridge_initial_version,
        lora_keep=args.bridge_lora_keep,
        run_id=run_id,
        config_path=config_path,
        served_model_name=(_flag(vllm_args, "--served-model-name") or model),
        insecure_no_token=args.insecure_no_token,
    )
    env[SETTINGS_ENV] = settings.model_dump_json()
    return settings, vllm_args, env


def write_config_file(settings: BridgeSettings, vllm_args: list[str]) -> Path:
    """Write this run's config; an old file (a previous run) is replaced, never reused."""
    path = Path(settings.config_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        try:
            old = json.loads(path.read_text())
            print(f"[bridge] replacing stale config of run {old.get('run_id')}", file=sys.stderr)
        except (OSError, ValueError):
            print(f"[bridge] replacing unreadable config {path}", file=sys.stderr)
    doc = BridgeConfigFile(
        run_id=settings.run_id,
        pid=os.getpid(),
        host=_flag(vllm_args, "--host") or "127.0.0.1",
        port=int(_flag(vllm_args, "--port") or VLLM_PORT),
        settings=settings,
        started_at=time.time(),
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(doc.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def missing_local_model(argv: list[str]) -> str | None:
    """The ``--model`` of ``argv`` if it is a local path that does not exist (one starting
    with ``/``, ``./``, ``../`` or ``~``; a hub id such as ``Qwen/Qwen2.5-0.5B`` never does)."""
    model = _flag(parse_args(expand_files(argv))[1], "--model")
    local = model is not None and model.startswith(("/", "./", "../", "~"))
    return model if local and not Path(model).expanduser().exists() else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP_FLAGS or a.startswith("--help=") for a in argv):
        sys.exit(print_help(argv))
    if missing := missing_local_model(argv):  # said at once, not after vLLM's imports (~15 s)
        raise SystemExit(f"{PROG}: --model {missing}: no such file or directory")
    settings, vllm_args, env = build(argv)
    if insecure := check_access(vllm_args, settings.insecure_no_token):
        print(f"[bridge] WARNING: {insecure}", file=sys.stderr, flush=True)
    os.environ.update(env)
    if env.get("TORCHDYNAMO_DISABLE") == "1" and "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True  # imported before (a forked start)
    path = write_config_file(settings, vllm_args)
    print(
        f"[bridge] mode={settings.mode} backend={settings.backend} config={path}", file=sys.stderr
    )
    sys.argv = ["vllm.entrypoints.openai.api_server", *vllm_args]
    startup_signals.install()  # a SIGTERM during the start ends it (vLLM's would hang)
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

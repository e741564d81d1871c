"""serve.py argument handling, the auth policy of the routes, and the trainer-side name checks."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.bridge import make_bridge
from trainer.bridge.params import check_against_server, hf_tensors
from vllm_patching.middleware import requires_token, token_ok
from vllm_patching.protocol import SETTINGS_ENV, TOKEN_ENV, TOKEN_HEADER, BridgeSettings
from vllm_patching.serve import build, check_access, write_config_file

pytestmark = pytest.mark.unit


def _build(*extra: str, environ: dict[str, str] | None = None):
    argv = ["--model", "/m", "--port", "8123", "--bridge-device", "cpu", *extra]
    return build(argv, environ={} if environ is None else environ)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("extra", "backend"),
    [((), "gloo_bcast"), (("--single-copy",), "shm"), (("--weight-bridge-mode", "none"), None)],
)
def test_backend_choice_on_cpu(extra: tuple[str, ...], backend: str | None) -> None:
    settings, argv, env = _build(*extra)
    assert settings.backend == backend
    if backend:
        assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": backend}
    else:
        assert "--weight-transfer-config" not in argv
    assert BridgeSettings.model_validate_json(env[SETTINGS_ENV]) == settings
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "shop_r1_bridge" in env["VLLM_PLUGINS"]


def test_cuda_backends_and_ipc_serialization() -> None:
    """Pickled IPC handles (``--single-copy`` on CUDA) only with the token: without it the
    server refuses to start, on loopback too and whatever ``--insecure-no-token`` says."""
    cuda_copy = ["--model", "/m", "--bridge-device", "cuda", "--single-copy"]
    settings, argv, env = build(cuda_copy, environ={TOKEN_ENV: "s3cret"})
    assert settings.backend == "ipc" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    for extra in ([], ["--insecure-no-token"]):
        with pytest.raises(SystemExit, match=f"needs a token on any address: set {TOKEN_ENV}"):
            build([*cuda_copy, *extra], environ={})
    settings, _, env = build(["--model", "/m", "--bridge-device", "cuda"], environ={})
    assert settings.backend == "nccl" and "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    settings, _, env = _build("--single-copy")  # shm on the CPU: JSON only, no pickles
    assert settings.backend == "shm" and "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env


def test_defaults_bind_localhost_and_add_worker_extension() -> None:
    _, argv, _ = _build()
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--worker-extension-cls").endswith("BridgeWorkerExtension")
    _, argv, _ = _build("--host", "0.0.0.0", environ={TOKEN_ENV: "s3cret"})
    assert argv.count("--host") == 1


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node7", ""])
def test_a_non_loopback_bind_needs_the_token_or_the_opt_out(host: str) -> None:
    """Fail closed: any address but loopback without the token exits with how to set it; the
    one opt-out starts it with an INSECURE warning (printed by main, logged by the plugin)."""
    with pytest.raises(SystemExit, match=f"refusing to serve on .* Set a token \\({TOKEN_ENV}="):
        _build("--host", host)
    settings, argv, _ = _build("--host", host, "--insecure-no-token")
    assert settings.insecure_no_token and "--insecure-no-token" not in argv  # ours, not vLLM's
    assert "INSECURE" in (check_access(argv, True, {}) or "")
    settings, argv, _ = _build("--host", host, environ={TOKEN_ENV: "s3cret"})
    assert check_access(argv, False, {TOKEN_ENV: "s3cret"}) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_token(host: str) -> None:
    settings, argv, _ = _build("--host", host)
    assert _flag(argv, "--host") == host and check_access(argv, False, {}) is None
    _, argv, _ = _build("--host", "0.0.0.0", "--uds", "/tmp/v.sock")  # a socket file
    assert check_access(argv, False, {}) is None


def test_the_opt_out_comes_from_a_run_file(tmp_path) -> None:
    """``vllm: {insecure_no_token: true}`` in a run file (what the launcher writes) is the
    flag; the file's ``host`` reaches vLLM too."""
    run = tmp_path / "run.yaml"
    run.write_text("vllm:\n  host: 0.0.0.0\n  insecure_no_token: true\n")
    settings, argv, _ = _build("--config", str(run))
    assert settings.insecure_no_token and _flag(argv, "--host") == "0.0.0.0"
    run.write_text("vllm:\n  host: 0.0.0.0\n")
    with pytest.raises(SystemExit, match="refusing"):
        _build("--config", str(run))


def test_rollout_logprobs_are_those_of_the_sampling_distribution() -> None:
    """The trainer's importance ratio needs logprobs after temperature: processed, unless the
    user asks for another mode."""
    _, argv, _ = _build()
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    _, argv, _ = _build("--logprobs-mode", "raw_logprobs")
    assert argv.count("--logprobs-mode") == 1 and _flag(argv, "--logprobs-mode") == "raw_logprobs"


def test_an_eager_server_compiles_nothing() -> None:
    """``--enforce-eager`` (the CPU default) turns torch.compile off in the server's processes,
    vLLM's compiled logprob-rank helper included; a server that compiles keeps it."""
    _, _, env = _build("--enforce-eager")
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    _, _, env = _build()
    assert "TORCHDYNAMO_DISABLE" not in env
    # the last of the pair counts, as in vLLM's parser: a run file's enforce_eager: false
    # after the launcher's CPU default --enforce-eager compiles
    _, _, env = _build("--enforce-eager", "--no-enforce-eager")
    assert "TORCHDYNAMO_DISABLE" not in env
    _, _, env = _build("--no-enforce-eager", "--enforce-eager")
    assert env["TORCHDYNAMO_DISABLE"] == "1"


def test_lora_mode_enables_runtime_lora() -> None:
    settings, argv, env = _build("--weight-bridge-mode", "lora_only", "--served-model-name", "pol")
    assert "--enable-lora" in argv and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert settings.served_model_name == "pol"


@pytest.mark.parametrize(
    "argv",
    [
        ["--weight-bridge-mode", "none", "--single-copy", "--model", "/m"],
        ["--weight-bridge-mode", "x", "--model", "/m"],
    ],
)
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build(argv)


def test_config_file_is_rewritten_per_run(tmp_path) -> None:
    path = tmp_path / "vllm_bridge_config.json"
    path.write_text('{"run_id": "old-run", "handles": "stale"}')
    settings, argv, _ = _build("--bridge-config", str(path), environ={TOKEN_ENV: "s3cret-v"})
    write_config_file(settings, argv)
    doc = json.loads(path.read_text())
    assert doc["run_id"] == settings.run_id != "old-run"
    assert doc["port"] == 8123 and "handles" not in doc
    assert "s3cret-v" not in path.read_text()


@pytest.mark.parametrize(
    ("method", "path", "guarded"),
    [
        ("POST", "/v1/completions", False),
        ("POST", "/v1/chat/completions", False),
        ("GET", "/bridge/info", False),
        ("HEAD", "/health", False),
        ("GET", "/v1/responses/resp-1", False),
        ("POST", "/v1/responses/resp-1/cancel", False),
        ("GET", "/metrics/", False),
        ("GET", "/is_paused", True),
        ("GET", "/server_info", True),
        ("GET", "/v1/responses/a/b", True),
        ("POST", "/v1/completions/", True),
        ("POST", "/inference/v1/abort_requests", True),
        ("OPTIONS", "/collective_rpc", True),
        ("OPTIONS", "/v1/completions", False),
        ("WEBSOCKET", "/some/future/socket", True),
        ("GET", "/some/future/route", True),
        ("POST", "/pause", True),
        ("POST", "/init_weight_transfer_engine", True),
        ("POST", "/update_weights", True),
        ("POST", "/collective_rpc", True),
        ("POST", "/v1/load_lora_adapter", True),
        ("POST", "/bridge/apply", True),
        ("DELETE", "/some/future/route", True),
    ],
)
def test_auth_policy_is_default_deny(method: str, path: str, guarded: bool) -> None:
    assert requires_token(method, path) is guarded


def test_token_check() -> None:
    assert token_ok({TOKEN_HEADER: "s3cret"}, "s3cret")
    assert token_ok({"authorization": "Bearer s3cret"}, "s3cret")
    assert not token_ok({TOKEN_HEADER: "wrong"}, "s3cret")
    assert not token_ok({}, "s3cret")


def test_hf_tensors_skip_tied_lm_head_and_check_names() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    names = [n for n, _ in hf_tensors(Qwen2ForCausalLM(cfg))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    param_map = {n: {} for n in names}
    check_against_server(names, param_map)
    with pytest.raises(ValueError, match="missing"):
        check_against_server([n for n in names if "k_proj" not in n], param_map)
    with pytest.raises(ValueError, match="unknown"):
        check_against_server([*names, "extra.weight"], param_map)
    assert torch.is_tensor(hf_tensors(Qwen2ForCausalLM(cfg))[0][1])


def test_make_bridge_rejects_bad_modes() -> None:
    with pytest.raises(ValueError, match="unknown bridge mode"):
        make_bridge("nope", ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="single_copy"):
        make_bridge("none", ["http://127.0.0.1:1"], single_copy=True)
    with pytest.raises(ValueError, match="save_dir"):
        make_bridge("lora_only", ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="reload_every"):
        make_bridge("shared_vllm", ["http://127.0.0.1:1"], reload_every=3)


def test_stage_and_apply_refuse_another_server_run_and_other_modes() -> None:
    """A trainer whose transfer was set up with an earlier run of the server (it restarted)
    gets 409 before anything is staged; the trainer then sets the transfer up again."""
    from fastapi import HTTPException

    from vllm_patching.middleware import BridgeState
    from vllm_patching.protocol import ApplyRequest, StageRequest
    from vllm_patching.routes import _check_run

    assert requires_token("POST", "/bridge/stage") and requires_token("POST", "/bridge/apply")
    settings = BridgeSettings(run_id="run-a", config_path="/x", served_model_name="tiny")
    st = BridgeState(settings)
    _check_run(st, "run-a")
    _check_run(st, None)  # callers that do not track restarts
    with pytest.raises(HTTPException) as e:
        _check_run(st, "run-b")
    assert e.value.status_code == 409 and "restarted" in e.value.detail
    st_none = BridgeState(settings.model_copy(update={"mode": "none"}))
    with pytest.raises(HTTPException) as e:
        _check_run(st_none, "run-a")
    assert e.value.status_code == 400
    assert ApplyRequest(version=3).update_info is None
    with pytest.raises(ValueError):
        StageRequest.model_validate({"run_id": "run-a"})  # update_info is required
    with pytest.raises(ValueError):
        ApplyRequest(version=-1)


def test_restart_mode_restarts_its_own_server_from_the_checkpoint(tmp_path) -> None:
    """The benchmark's legacy restart mode (bench/sync/variants.py): each sync saves the
    weights and asks the server object the bridge was given to restart from them
    (``BridgeServer.restart``, launch/vllm_server.py)."""
    from bench.sync.variants import bench_bridge

    class Server:
        def __init__(self, model: str = "start", version: int = 0) -> None:
            self.model, self.version = model, version

        def restart(self, model, initial_version: int) -> Server:
            return Server(str(model), initial_version)

    kw = {"save_dir": tmp_path, "restart": True, "server": Server()}
    bridge = bench_bridge("none", "http://127.0.0.1:9", "token", kw)
    try:
        stats = bridge.sync(torch.nn.Linear(2, 2), version=3)
    finally:
        bridge.close()
    assert bridge.server.model == str(tmp_path / "v3") and bridge.server.version == 3
    assert (tmp_path / "v3" / "model.safetensors").exists()
    assert stats.detail["servers"][0]["restarted"] is True

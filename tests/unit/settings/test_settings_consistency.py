"""One value for each shared default (issue #19, item 5): the dataset size every command builds
and checks, the ports every service listens on and every client expects; a mismatch is a clear
error, never a silent swap."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from api.config import ApiConfig
from api.service_check import API_SERVICE, WrongService, check_service
from env_server.config import EnvConfig
from env_server.data.dataset import MANIFEST, DatasetMismatch, build_and_save, load_or_build
from settings import paths, ports
from settings.ports import free_port
from trainer.config import GrpoConfig, SftConfig

pytestmark = pytest.mark.unit


def test_one_dataset_size_for_every_command() -> None:
    """No command has a size of its own: unset, each uses the dataset on disk, or builds
    settings.paths.NUM_SESSIONS (the SFT used to build 400, the env 3000)."""
    assert EnvConfig().num_sessions is None and SftConfig().num_sessions is None
    from env_server.data.dataset import build_dataset

    assert build_dataset.__defaults__[0] == paths.NUM_SESSIONS == 3000


def test_load_or_build_checks_what_it_loads(tmp_path: Path) -> None:
    d = tmp_path / "data"
    built = load_or_build(d, 12, seed=0)  # missing: built, with its manifest
    assert json.loads((d / MANIFEST).read_text()) == {
        "source": "simulated",
        "num_sessions": 12,
        "seed": 0,
    }
    assert load_or_build(d, 12)["test"].to_list() == built["test"].to_list()
    assert load_or_build(d)["train"].num_rows == built["train"].num_rows  # unset: as it is
    with pytest.raises(DatasetMismatch, match=r"12 sessions \(seed 0\).*20 sessions"):
        load_or_build(d, 20)
    with pytest.raises(DatasetMismatch, match="seed 1"):
        load_or_build(d, 12, seed=1)
    assert json.loads((d / MANIFEST).read_text())["num_sessions"] == 12  # nothing overwritten
    (d / MANIFEST).unlink()  # an older folder: its sessions are counted
    assert load_or_build(d, 12)["train"].num_rows == built["train"].num_rows
    with pytest.raises(DatasetMismatch, match="12 sessions.*--data-dir"):
        load_or_build(d, 30)


def test_a_runs_seed_does_not_choose_its_dataset(tmp_path: Path) -> None:
    """``--seed 1 --num-sessions 12`` trains and evaluates on the dataset of the data seed:
    the env and the SFT ask for the dataset by size only (before, the run's seed reached
    ``load_or_build`` and a dataset built by the launcher was a mismatch, "seed 1 asked")."""
    import inspect

    from trainer.sft_data import load_or_build_dataset

    assert list(inspect.signature(load_or_build_dataset).parameters) == ["data_dir", "num_sessions"]
    d = tmp_path / "data"
    built = load_or_build_dataset(d, 12)  # missing: built with the data seed
    assert json.loads((d / MANIFEST).read_text())["seed"] == paths.DATA_SEED
    build_and_save(12, 1, tmp_path / "other")  # a dataset of another seed, built on purpose
    assert load_or_build(d, 12)["test"].to_list() == built["test"].to_list()
    assert load_or_build(tmp_path / "other", 12)["test"].to_list() != built["test"].to_list()


def test_converted_data_is_taken_as_it_is(tmp_path: Path) -> None:
    build_and_save(12, 0, tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"source": "converted", "seed": 0}))
    assert load_or_build(tmp_path, 3000)["train"].num_rows > 0


def test_default_ports_are_distinct_and_every_client_agrees() -> None:
    assert ports.API_PORT != ports.VLLM_PORT and 8000 == ports.API_PORT  # vLLM's own: 8000
    assert ApiConfig().port == ports.API_PORT
    assert EnvConfig().api_url == GrpoConfig().api_url == ports.API_URL
    assert EnvConfig().inference_urls() == GrpoConfig().inference_urls() == [ports.VLLM_URL]
    from vllm_patching.serve import build

    _, vllm_args, _ = build(["--model", "m", "--bridge-device", "cpu"])
    assert vllm_args[vllm_args.index("--port") + 1] == str(ports.VLLM_PORT)


def _serve(routes: dict[str, tuple[int, object]]) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            code, body = routes.get(self.path, (404, {"detail": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_url_that_answers_as_another_service_is_named() -> None:
    vllm, vllm_url = _serve({"/health": (200, {}), "/v1/models": (200, {"data": []})})
    api, api_url = _serve({"/health": (200, {"status": "ok", "service": API_SERVICE})})
    try:
        check_service(api_url, "api")
        check_service(vllm_url, "inference")
        with pytest.raises(WrongService, match="not the batching API.*port 8000.*9001"):
            check_service(vllm_url, "api")  # the env's --api-url pointed at vLLM
        with pytest.raises(WrongService, match="not an OpenAI-compatible inference server"):
            check_service(api_url, "inference")
    finally:
        vllm.shutdown()
        api.shutdown()
    check_service(f"http://127.0.0.1:{free_port()}", "api")  # not up yet: the retries wait


def test_a_service_that_asks_for_credentials_or_fails_is_not_called_wrong() -> None:
    """Only a positive answer names a wrong service: our API with a token answers /health with
    401 to a caller without it, and a 503 is a service still starting (the retries wait)."""
    denied = (401, {"detail": "missing or wrong API token"})
    locked, locked_url = _serve({"/health": denied, "/v1/models": denied})
    busy, busy_url = _serve({"/v1/models": (503, {"detail": "starting"})})
    try:
        check_service(locked_url, "api")
        check_service(locked_url, "inference")
        check_service(busy_url, "inference")
    finally:
        locked.shutdown()
        busy.shutdown()

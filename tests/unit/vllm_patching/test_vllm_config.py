"""The ``vllm:`` section (``vllm_patching.config.VllmConfig``): the options the project sets are
typed fields (a wrong value is an error naming the key), any other key passes to vLLM as it
is, and the vLLM command lines of the shipped runs stay what they were (pinned below)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.configs import resolve_for_run, write_service_configs
from launch.run_config import resolve_run
from launch.run_plan import vllm_extra
from launch.vllm_server import server_argv
from settings.paths import REPO_ROOT, RUNS_DIR, SFT_MODEL_DIR, SMOL_SFT_MODEL_DIR
from vllm_patching.config import VllmConfig
from vllm_patching.serve import build, file_argv, main, missing_local_model

pytestmark = pytest.mark.unit
RECIPES = REPO_ROOT / "recipes"
TAIL = [
    "--logprobs-mode",
    "processed_logprobs",
    "--worker-extension-cls",
    "vllm_patching.worker_ext.BridgeWorkerExtension",
]
"""What ``vllm_patching.serve`` adds to every server."""


def _launched(argv: list[str], run_dir: Path, device: list[str], cpu: bool = True) -> list[str]:
    """The vLLM argv of launch/run_all.sh ``argv``'s server: its ``<run>/config/vllm.yaml``,
    the launcher's flags, through ``vllm_patching.serve.build`` (as launch/run_all.py does)."""
    cfg = resolve_for_run(argv, "http://127.0.0.1:8000", ["http://127.0.0.1:9001"], run_dir)
    config = write_service_configs(run_dir, cfg)["vllm"]
    extra = ["--config", str(config), *vllm_extra(cfg), *device]
    mode, bridge = cfg.weight_bridge_mode, run_dir / "b.json"
    cmd = server_argv(str(cfg.model), 9001, mode, bridge, extra=extra, cpu=cpu)
    return build(cmd[3:])[1]


def _serving(model: Path) -> list[str]:
    return ["--model", str(model), "--host", "127.0.0.1", "--port", "9001"]


def test_the_vllm_argv_of_a_gpu_recipe_and_of_cpu_smol_is_pinned(tmp_path: Path) -> None:
    gpu = RECIPES / "qwen2.5-0.5b-instruct" / "shop-r1" / "grpo.yaml"
    argv = _launched(["--preset", "gpu-0.5b", "--recipe", str(gpu)], tmp_path / "gpu", [], False)
    assert argv == [
        *_serving(RUNS_DIR / "qwen2.5-0.5b-instruct" / "shop-r1" / "sft"),
        *["--served-model-name", "tiny"],
        *["--seed", "0", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"],
        *["--max-model-len", "4096"],
        *["--weight-transfer-config", '{"backend": "nccl"}', *TAIL],
    ]
    # a preset alone on CUDA: no CPU default caps its 3072 + 256-token context or its CUDA graphs
    argv = _launched(["--preset", "gpu-0.5b"], tmp_path / "gpu0", [], False)
    assert "--max-model-len" not in argv and "--enforce-eager" not in argv
    smol = ["--bridge-device", "cpu"]  # what "auto" finds on a CPU box
    argv = _launched(["--preset", "cpu-smol"], tmp_path / "smol", smol)
    assert argv == [
        *_serving(SMOL_SFT_MODEL_DIR),
        *["--served-model-name", "tiny", "--enforce-eager", "--dtype", "float32"],
        *["--max-model-len", "2048"],
        *["--weight-transfer-config", '{"backend": "gloo_bcast"}', *TAIL],
    ]
    # on the CPU the launcher's defaults stand before the file, which wins (vLLM takes the last)
    tiny = RECIPES / "tiny-qwen2" / "shop-r1" / "grpo.yaml"
    cpu = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
    argv = _launched(["--recipe", str(tiny)], tmp_path / "tiny", smol)
    assert argv == [
        *_serving(SFT_MODEL_DIR),
        *["--served-model-name", "tiny", *cpu, "--seed", "0", *cpu],
        *["--weight-transfer-config", '{"backend": "gloo_bcast"}', *TAIL],
    ]
    # started on its own from the recipe: the section's fields in their declared order
    assert build(["--config", str(tiny), "--bridge-device", "cpu"])[1] == [
        *["--model", str(SFT_MODEL_DIR), "--seed", "0"],
        *["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"],
        *["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "9001"],
        *["--weight-transfer-config", '{"backend": "gloo_bcast"}', *TAIL],
    ]


def test_known_options_are_typed_and_others_pass_through(tmp_path: Path) -> None:
    flat = tmp_path / "vllm.yaml"
    flat.write_text(
        "vllm:\n  max_model_len: '2048'\n  enforce_eager: true\n  max_num_batched_tokens: 8192\n"
        "  compilation_config: {level: 0}\n"
    )
    assert file_argv(flat) == [
        *["--enforce-eager", "--max-model-len", "2048"],  # typed fields first
        *["--max-num-batched-tokens", "8192", "--compilation-config", '{"level": 0}'],
    ]
    assert VllmConfig(max_model_len="4k").max_model_len == "4k"  # vLLM's own spelling
    assert VllmConfig(max_model_len="auto").max_model_len == "auto"
    assert VllmConfig.model_fields["dtype"].description  # documented (--help of the launcher)
    vllm = resolve_run(["--vllm.max-model-len", "4k", "--vllm.max-num-seqs", "8"]).vllm
    assert (vllm.max_model_len, vllm.max_num_seqs) == ("4k", 8)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("dtype: float33\n", "dtype"),
        ("gpu_memory_utilization: lots\n", "gpu_memory_utilization"),
        ("gpu_memory_utilization: 1.5\n", "gpu_memory_utilization"),
        ("max_model_len: long\n", "max_model_len"),
        ("enforce_eager: maybe\n", "enforce_eager"),
        ("max_num_seqs: 0\n", "max_num_seqs"),
    ],
)
def test_a_wrong_value_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("vllm:\n  " + text)
    with pytest.raises(SystemExit, match=rf"vllm\.{key} \(set by file {run}\)"):
        file_argv(run)
    with pytest.raises(SystemExit, match=rf"invalid RunConfig(.|\n)*vllm\.{key}"):
        resolve_run(["--recipe", str(run)], environ={})


def test_the_real_parsers_keep_the_last_value_of_every_kind_of_option() -> None:
    """A file's options go before the command line's (``serve.expand_files``): vLLM 0.32's own
    parser and the bridge's keep the last value given of a plain option, a boolean (``--x`` /
    ``--no-x``), a list and a JSON mapping, so the command line wins over the file."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_patching.serve import mapping_argv, parse_args

    parser = make_arg_parser(FlexibleArgumentParser())
    file = mapping_argv(
        {
            **{"model": "a", "dtype": "float32", "max_model_len": 2048, "enforce_eager": True},
            **{"enable_prefix_caching": False, "served_model_name": ["x", "y"]},
            "override_generation_config": {"a": 1},
        }
    )
    flags = ["--model", "b", "--dtype", "bfloat16", "--max-model-len", "4k", "--no-enforce-eager"]
    flags += ["--enable-prefix-caching", "--served-model-name", "z"]
    flags += ["--override-generation-config", '{"b": 2}']
    ns = parser.parse_args([*file, *flags])
    assert (ns.model, ns.dtype, ns.max_model_len, ns.enforce_eager) == (
        "b",
        "bfloat16",
        4000,
        False,
    )
    assert (ns.enable_prefix_caching, ns.served_model_name) == (True, ["z"])
    assert ns.override_generation_config == {"b": 2}  # replaced, not merged
    ns = parser.parse_args([*flags, *file])
    assert (ns.model, ns.dtype, ns.max_model_len, ns.enforce_eager) == ("a", "float32", 2048, True)
    assert (ns.enable_prefix_caching, ns.served_model_name) == (False, ["x", "y"])
    assert ns.override_generation_config == {"a": 1}
    # the bridge's parser (its booleans are plain flags: a file's false is left out)
    file = mapping_argv({"weight_bridge_mode": "none", "bridge_lora_keep": 3, "single_copy": False})
    args, rest = parse_args([*file, "--weight-bridge-mode", "lora_only", "--bridge-lora-keep", "5"])
    assert (args.weight_bridge_mode, args.bridge_lora_keep, args.single_copy, rest) == (
        "lora_only",
        5,
        False,
        [],
    )
    assert parse_args(mapping_argv({"single_copy": True}))[0].single_copy


def test_a_local_model_path_that_does_not_exist_is_refused_before_vllm(tmp_path: Path) -> None:
    """Said at once, not after vLLM's imports; a hub id (no leading ``/``, ``.``, ``~``) is
    vLLM's to resolve."""
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(SystemExit, match=f"--model {missing}: no such file or directory"):
        main(["--model", missing, "--bridge-device", "cpu"])
    assert missing_local_model(["--model", missing]) == missing
    assert missing_local_model(["--model", str(tmp_path)]) is None
    assert missing_local_model(["--model", "Qwen/Qwen2.5-0.5B"]) is None

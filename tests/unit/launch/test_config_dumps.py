"""Every shipped recipe and preset resolves to the same values as before issue 47's config
rework (lists as lists, the loss and the weight transport as unions): the full run config,
the launcher's run config (its wiring included) and the files it writes into a run dir.

The expected dumps (tests/unit/data/config_dumps/*.json) were written by the code before the
rework; rewrite them with ``SHOP_R1_PIN_DUMPS=1`` only after a deliberate change of values.
Each dump is compared key by key in the old spelling (:func:`old_spelling`): a field that
another change added since is not in the dump and is not compared."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.configs import resolve_for_run, write_service_configs
from launch.run_config import RunConfig, resolve_run
from settings import paths
from settings.paths import REPO_ROOT
from trainer.weights_config import BY_TYPE

pytestmark = pytest.mark.unit
RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
DUMPS = Path(__file__).parent.parent / "data" / "config_dumps"
API_URL = "http://127.0.0.1:8000"
VLLM_URLS = ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
PIN = bool(os.environ.get("SHOP_R1_PIN_DUMPS"))
"""Rewrite the dumps (read before ``clean_environ`` clears every ``SHOP_R1_`` variable)."""
UNSTABLE = {("trainer", "sft", "resume"), ("trainer", "sft", "overwrite")}
"""The launcher's SFT resume/overwrite depend on what artifacts/ holds now (an interrupted SFT
left ``checkpoints/``): not compared wherever they sit (the run, what is launched, the files)."""


def _argv(recipe: Path) -> list[str]:
    if recipe.parent.name == "presets":
        return ["--preset", recipe.stem]
    return ["--recipe", str(recipe)]


def _named(data: Any) -> Any:
    """``data`` with the project's locations as ``${NAME}`` (machine-independent)."""
    text = json.dumps(data, sort_keys=True)
    for name in ("RUNS_DIR", "ARTIFACTS", "REPO_ROOT"):
        text = text.replace(str(getattr(paths, name)), f"${{{name}}}")
    return json.loads(text)


LISTS = {"launch": ("gpus",), "trainer.grpo": ("inference_url", "atropos_metadata_keys")}
LISTS |= {"trainer.sft": ("lora_target_modules",)}
LISTS["trainer.grpo"] += LISTS["trainer.sft"]
"""Fields that held one comma-joined string before the rework."""


def _flat_loss(grpo: dict[str, Any]) -> dict[str, Any]:
    """``trainer.grpo`` with its ``loss:`` section as the flat keys it was (``policy_loss``)."""
    out = dict(grpo)
    if isinstance(loss := out.pop("loss", None), dict):
        loss = dict(loss)
        out["policy_loss"] = loss.pop("type")
        out |= loss
    return out


def _flat_weights(grpo: dict[str, Any]) -> dict[str, Any]:
    """``trainer.grpo`` with its ``weights:`` section as the keys it was: the pair
    ``weight_bridge_mode`` + ``single_copy`` and ``reload_every`` (1 where unused)."""
    out = dict(grpo)
    if isinstance(weights := out.pop("weights", None), dict):
        member = BY_TYPE[weights["type"]]
        out |= {"weight_bridge_mode": member.mode, "single_copy": member.single_copy}
        out["reload_every"] = weights.get("reload_every", 1)
    return out


def _joined(section: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``section``'s list fields ``names`` as the comma-joined strings they were."""
    out = dict(section)
    for name in names:
        if isinstance(out.get(name), list):
            out[name] = ",".join(out[name])
    return out


def old_spelling(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` dumped with the keys and values the code before the rework had."""
    data = cfg.model_dump(mode="json", exclude={"recipe"})
    data["launch"] = _joined(data["launch"], LISTS["launch"])
    data["trainer"]["grpo"] = _flat_weights(_flat_loss(data["trainer"]["grpo"]))
    for name in ("sft", "grpo"):
        data["trainer"][name] = _joined(data["trainer"][name], LISTS[f"trainer.{name}"])
    return data


def old_file(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A written service file (``<run>/config/<name>.yaml``) in the old spelling."""
    if name == "trainer_grpo":
        grpo = _flat_weights(_flat_loss(data["trainer"]["grpo"]))
        return {"trainer": {"grpo": _joined(grpo, LISTS["trainer.grpo"])}}
    return data


def _dumps(recipe: Path, run_dir: Path) -> dict[str, Any]:
    run = resolve_run(_argv(recipe), environ={})
    launched = resolve_for_run(_argv(recipe), API_URL, VLLM_URLS, run_dir, environ={}, warn=False)
    files = write_service_configs(run_dir, launched)
    written = {n: old_file(n, yaml.safe_load(path.read_text())) for n, path in files.items()}
    return _named({"run": old_spelling(run), "launched": old_spelling(launched), "files": written})


def _missing(expected: Any, got: Any, where: tuple[str, ...] = ()) -> list[str]:
    """Where ``got`` differs from ``expected`` (keys ``expected`` lacks are not compared)."""
    if where[-3:] in UNSTABLE:
        return []
    if isinstance(expected, dict) and isinstance(got, dict):
        return [
            m
            for k, v in expected.items()
            for m in (
                _missing(v, got[k], (*where, k)) if k in got else [f"{'.'.join(where)}.{k}: gone"]
            )
        ]
    return [] if expected == got else [f"{'.'.join(where)}: {expected!r} -> {got!r}"]


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SHOP_R1_API_TOKEN", "SHOP_R1_BRIDGE_TOKEN", "HF_TOKEN", "NUM_INFERENCE_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith(("GAIL_", "SHOP_R1_"))]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
@pytest.mark.usefixtures("clean_environ")
def test_every_recipe_resolves_to_the_values_it_had(recipe: Path, tmp_path: Path) -> None:
    name = str(recipe.relative_to(REPO_ROOT / "recipes")).replace("/", "__")
    dump_file = DUMPS / f"{name.removesuffix('.yaml')}.json"
    text = json.dumps(_dumps(recipe, tmp_path / "run"), sort_keys=True)
    got = json.loads(text.replace(str(tmp_path / "run"), "${RUN_DIR}"))
    if PIN:
        DUMPS.mkdir(parents=True, exist_ok=True)
        dump_file.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert _missing(json.loads(dump_file.read_text()), got) == []

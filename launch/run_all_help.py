"""The help of ``launch/run_all.sh --help``: each flag's choices and default, and the epilog
(environment variables, where the run's page lands)."""

from __future__ import annotations

import typing
from typing import Any, Literal

HELP_EPILOG = """environment: SHOP_R1_ARTIFACTS (where the tiny model, dataset and SFT checkpoint
live), NUM_INFERENCE_NODES, MASTER_ADDR/MASTER_PORT, CUDA_VISIBLE_DEVICES,
VLLM_CPU_KVCACHE_SPACE; console progress: SHOP_R1_PROGRESS=plain (plain lines on a terminal
too), SHOP_R1_PROGRESS_INTERVAL (seconds between plain lines, default 30).
The run directory ends with report.html (launch/report.py): open it in a browser."""


def flag_help(field: Any) -> dict[str, Any]:
    """argparse's ``choices`` and ``help`` of a config field: its description and default."""
    literal = typing.get_origin(field.annotation) is Literal
    shown = "" if field.default_factory or field.default is None else f" (default: {field.default})"
    return {
        "choices": typing.get_args(field.annotation) if literal else None,
        "help": (field.description + shown).replace("%", "%%"),
    }

"""The epilog of ``launch/run_all.sh --help`` (environment variables, where the run's page
lands); the flags themselves, with their choices and defaults, come from ``RunConfig``
through settings/layers.py."""

from __future__ import annotations

HELP_EPILOG = """environment: SHOP_R1_ARTIFACTS (where the tiny model, dataset and SFT checkpoint
live), NUM_INFERENCE_NODES, MASTER_ADDR/MASTER_PORT, CUDA_VISIBLE_DEVICES,
VLLM_CPU_KVCACHE_SPACE; console progress: SHOP_R1_PROGRESS=plain (plain lines on a terminal
too), SHOP_R1_PROGRESS_INTERVAL (seconds between plain lines, default 30).
Precedence: defaults < the --preset file < the --recipe file < environment
(SHOP_R1_<SECTION>__<FIELD>) < these flags (dotted: --trainer.grpo.lr 1e-5); each service's
resolved section is written to <run>/config/<service>.yaml (docs/RECIPES.md).
The run directory ends with report.html (launch/report.py): open it in a browser."""

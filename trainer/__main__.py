"""``python -m trainer sft|grpo [--config recipe.yaml] [--flag value ...]``.

Thin entry point: parse and validate the config first (no torch import, so ``--help`` and
config errors are instant), then import the trainer and run it.
"""

from __future__ import annotations

import argparse
import sys

from trainer.config import GrpoConfig, SftConfig, build_parser, config_from_args

COMMANDS = {
    "sft": (SftConfig, "Supervised cold start on the Shop-R1 dataset."),
    "grpo": (GrpoConfig, "GRPO on scored groups leased from the batching API."),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, help_text) in COMMANDS.items():
        build_parser(cls, sub.add_parser(name, help=help_text, description=cls.__doc__))
    ns = parser.parse_args(argv)
    cfg = config_from_args(COMMANDS[ns.command][0], ns)

    from trainer.run import setup_logging  # imports torch

    setup_logging()
    if ns.command == "sft":
        from trainer.sft import train as train_sft

        train_sft(cfg)
    else:
        from trainer.grpo import train as train_grpo

        train_grpo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

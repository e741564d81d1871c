"""``python -m trainer sft|grpo [--config FILE] [--flag value ...]``.

Thin entry point: parse and validate the config first (no torch import, so ``--help`` and
config errors are instant), log the resolved config, then import the trainer and run it.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

from settings.cli import report, resolve_args
from trainer import PARENT_AT_START
from trainer.agent_death import die_with_agent
from trainer.config import SECTIONS, GrpoConfig, SftConfig, build_parser

EXIT_CHECKPOINT_WRITE = 74
"""Exit status when a checkpoint could not be written (sysexits' EX_IOERR): a full disk."""
EXIT_SYNC_TIMEOUT = 75
"""Exit status when a weight sync's phase missed its deadline (sysexits' EX_TEMPFAIL): an
inference server that hangs (docs/FAULT_TOLERANCE.md, "A weight sync that hangs")."""
COMMANDS = {
    "sft": (SftConfig, "Supervised cold start on the Shop-R1 dataset."),
    "grpo": (GrpoConfig, "GRPO on scored groups leased from the batching API."),
}


def main(argv: list[str] | None = None) -> int:
    die_with_agent(PARENT_AT_START)  # a torchrun rank dies with torchrun (agent_death.py)
    # `kill -USR1 PID` writes every thread's Python stack to the log: where a trainer that
    # stopped making progress is waiting (the tests ask for it before they give up on one)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, help_text) in COMMANDS.items():
        build_parser(cls, sub.add_parser(name, help=help_text, description=cls.__doc__))
    ns = parser.parse_args(argv)
    cls = COMMANDS[ns.command][0]
    cfg = resolve_args(cls, ns, SECTIONS[cls])
    if ns.print_config:
        print(report(cfg))
        return 0
    if ns.command == "grpo":  # a URL that answers as another service: say so before torch
        from api.service_check import check_services

        check_services(cfg.api_url, cfg.inference_urls(), cfg.api_token)

    from trainer.run import setup_logging  # imports torch

    setup_logging()
    logging.getLogger("trainer").info("%s config:\n%s", ns.command, report(cfg))
    from trainer.bridge.deadline import SyncTimeout
    from trainer.checkpoint import CheckpointWriteError
    from trainer.distributed import shutdown

    try:
        if ns.command == "sft":
            from trainer.sft import train as train_sft

            run = train_sft(cfg)
        else:
            from trainer.grpo import train as train_grpo

            run = train_grpo(cfg)
    except CheckpointWriteError as e:  # a full disk: say so plainly, no traceback to read
        logging.getLogger("trainer").error("STOPPED: %s", e)
        return EXIT_CHECKPOINT_WRITE
    except SyncTimeout as e:  # a server that hangs: every acked batch is in a checkpoint
        logging.getLogger("trainer").error(
            "STOPPED: %s. Every batch acked so far is in a checkpoint; the resumed trainer "
            "re-syncs the checkpoint's weights first.",
            e,
        )
        return EXIT_SYNC_TIMEOUT
    shutdown(run.dist)  # under torchrun: leave the process group cleanly
    return 0


if __name__ == "__main__":
    sys.exit(main())

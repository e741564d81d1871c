"""``python -m env_server``: the Shop-R1 environment service (see ``env_server/service.py``)."""

from __future__ import annotations

import asyncio
import logging


def main(argv: list[str] | None = None) -> None:
    from env_server.config import parse_config
    from settings.cli import report

    cfg = parse_config(argv)  # config errors surface before anything heavy is imported
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("env_server").info("config:\n%s", report(cfg))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    from api.service_check import check_services

    # a URL that answers as another service: say so now
    check_services(cfg.api_url, cfg.inference_urls(), cfg.api_token)
    from env_server.service import serve, write_summary

    write_summary(asyncio.run(serve(cfg)), cfg.metrics_path)


if __name__ == "__main__":
    main()

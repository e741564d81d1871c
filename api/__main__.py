"""``python -m api`` / ``shop-r1-api``: the batching API (see api/README.md)."""

from __future__ import annotations

import logging


def main(argv: list[str] | None = None) -> None:
    from api.config import check_exposure, parse_config
    from api.guard import url_safe
    from settings.cli import report

    cfg = parse_config(argv)  # config errors surface before the server is imported
    insecure = check_exposure(cfg)  # a non-loopback bind without a token: exits here
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("api")
    log.info("config:\n%s", report(cfg))
    if insecure:
        log.warning(insecure)
    if cfg.token and not url_safe(cfg.token):
        log.warning(
            "the token has characters a URL path cannot carry as they are: clients that send "
            "a header are fine, the capability URL /t/<token>/... needs a URL-safe token"
        )
    import uvicorn

    from api.app import create_app

    app = create_app(cfg)
    log.info(
        "serving on http://%s:%d (db %s, synchronous=%s, token %s)",
        cfg.host,
        cfg.port,
        cfg.db_path,
        cfg.synchronous,
        "required: a header or the capability URL /t/<token>/" if cfg.token else "off",
    )
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)
    finally:
        app.state.store.close()


if __name__ == "__main__":
    main()

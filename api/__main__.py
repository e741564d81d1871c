"""``python -m api`` / ``shop-r1-api``: the batching API (see api/README.md)."""

from __future__ import annotations

import logging


def main(argv: list[str] | None = None) -> None:
    from api.config import parse_config
    from settings.cli import report

    cfg = parse_config(argv)  # config errors surface before the server is imported
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("api").info("config:\n%s", report(cfg))
    import uvicorn

    from api.app import create_app

    app = create_app(cfg)
    logging.getLogger("api").info(
        "serving on http://%s:%d (db %s, synchronous=%s, token %s)",
        cfg.host,
        cfg.port,
        cfg.db_path,
        cfg.synchronous,
        "required" if cfg.token else "off",
    )
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)
    finally:
        app.state.store.close()


if __name__ == "__main__":
    main()

"""The FastAPI application: the store, the request guard and both routers."""

from __future__ import annotations

import sqlite3

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api import atropos, routes
from api.atropos_book import AtroposBook
from api.config import ApiConfig
from api.guard import RequestGuard
from api.storage import DiskGuard, StorageUnavailable
from api.store import Store


def create_app(cfg: ApiConfig, store: Store | None = None) -> FastAPI:
    """Build the app on ``cfg.db_path`` (or on ``store``, for tests). The caller closes
    ``app.state.store`` when done (not a shutdown hook: test clients start and stop an app's
    lifespan many times; every reply was committed anyway)."""
    if store is None:
        store = Store(
            cfg.db_path,
            max_staleness=cfg.max_staleness,
            synchronous=cfg.synchronous,
            default_batch_sequences=cfg.default_batch_sequences,
            env_timeout_s=cfg.env_timeout_s,
            rate_window_s=cfg.rate_window_s,
            min_free_bytes=int(cfg.min_free_mb * 2**20),
        )
    app = FastAPI(
        title="Shop-R1 batching API",
        description="Durable, lease-based, version-aware queue of scored groups between the "
        "environments and the trainer; also speaks the Atropos run-api protocol.",
        version="1.0",
    )
    app.state.store = store
    app.state.atropos = AtroposBook(store)
    app.state.config = cfg
    app.include_router(routes.router)
    app.include_router(atropos.router)
    app.add_exception_handler(RequestValidationError, _validation_error)
    install_storage_errors(app, store.disk)  # a full disk: 507/503 with the reason, not 500
    # Outermost: nothing (docs included) is reachable without the token when one is set.
    app.add_middleware(RequestGuard, token=cfg.token, max_body_bytes=cfg.max_body_bytes)
    return app


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each problem. The offending input is not echoed back: it can be large, and
    a NaN in it would make the error reply itself unserialisable (a 500)."""
    assert isinstance(exc, RequestValidationError)
    detail = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type")}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def install_storage_errors(app: FastAPI, guard: DiskGuard) -> None:
    """Answer storage errors from any route with 507/503 and the reason (api/storage.py);
    other SQLite errors stay 500s."""

    def reply(err: StorageUnavailable) -> JSONResponse:
        status, body, headers = guard.refusal(err)
        return JSONResponse(body, status_code=status, headers=headers)

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StorageUnavailable)
        return reply(exc)

    async def sqlite_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, sqlite3.Error)
        err = guard.from_sqlite(exc)
        if err is None:
            raise exc
        return reply(err)

    app.add_exception_handler(StorageUnavailable, unavailable)
    app.add_exception_handler(sqlite3.Error, sqlite_error)

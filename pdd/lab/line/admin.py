"""The emulator's HTTP control surface, and uvicorn run inside the caller's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from pdd.lab.line.relay import LineRelay, Route
from pdd.process import identity


class _LineUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bandwidth_mbps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    delay_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    jitter_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class _NewRoute(BaseModel):
    model_config = ConfigDict(extra="forbid")
    route: str = Field(description="LISTEN_HOST:PORT=TARGET_HOST:PORT")


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stall_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    drop: bool | None = None
    blackhole: bool | None = None


def admin_app(relay: LineRelay) -> FastAPI:
    """The HTTP control surface, so benchmarks and chaos tests can drive the line."""
    app = FastAPI(title="pdd line admin")
    line = relay.line

    @app.get("/health")
    def health() -> dict[str, object]:
        return {"status": "ok", **identity()}

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        return relay.stats()

    @app.post("/line")
    def reshape_line(update: _LineUpdate) -> dict[str, Any]:
        line.reshape(update.bandwidth_mbps, update.delay_ms, update.jitter_ms)
        return relay.stats()

    @app.post("/routes")
    async def add_route(req: _NewRoute) -> dict[str, Any]:
        try:
            route = Route.parse(req.route)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        try:
            await relay.add_route(route)
        except OSError as e:
            raise HTTPException(409, f"cannot listen on {route.listen_host}:{route.listen_port}: {e}") from None
        return relay.stats()

    @app.post("/fault")
    def fault(req: _Fault) -> dict[str, Any]:
        if req.stall_s is None and req.drop is None and req.blackhole is None:
            raise HTTPException(422, "give one of stall_s, drop, blackhole")
        if req.blackhole is not None:
            line.blackhole(req.blackhole)
        if req.drop:
            line.drop_all()
        if req.stall_s is not None:
            line.stall(req.stall_s)
        return relay.stats()

    return app


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn in our event loop; signals stay with whoever owns the loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AdminServer:
    """Runs `admin_app` with uvicorn inside the current event loop."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family)  # bound now: port 0 resolves, errors surface
        self.url = f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self._server = _EmbeddedUvicorn(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("line admin server stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None and not self._task.done():
            await self._task
        self._sock.close()

"""The console's web app (Starlette): the page, its live feed (server-sent events) and ``/metrics``.

Routes: ``/`` the machines (``machines.html``, ``machines.js``: each machine's condition, recent
answers, alerts, field accuracy and serving model), ``/learning`` the learning view (``index.html``,
``console.js``: devices, curves, rounds, rollouts); no third-party code: the plots are SVG drawn
by those scripts; ``/api/view`` the fleet as JSON (both views' data); ``/events`` the same JSON
again whenever the store or a status changes (``text/event-stream``); ``/metrics``
Prometheus's text format (:class:`cloud_aggregator.console.metrics.FleetCollector`).

With a token every route wants it: ``Authorization: Bearer <token>`` (Prometheus,
scripts), or the cookie that opening ``/?token=<token>`` once sets (a browser).
"""

from __future__ import annotations

import hmac
import json
import math
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cloud_aggregator.console.feed import ViewSource
from cloud_aggregator.console.machines_metrics import MachinesCollector
from cloud_aggregator.console.machines_view import machines_of, view_json
from cloud_aggregator.console.metrics import FleetCollector

COOKIE = "ioft_console"
#: Host headers a console on loopback answers (its own bind address is added).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
#: Live ``/events`` streams one client address may hold, and all clients together: each stream is
#: a task and a socket, so an unbounded number of them is a way to exhaust the console.
STREAMS_PER_CLIENT = 8
STREAMS_TOTAL = 64
#: Seconds between keep-alive comments on a quiet event stream (proxies drop silent ones).
KEEPALIVE_S = 15.0


def _page(name: str) -> str:
    return resources.files("cloud_aggregator.console").joinpath("page", name).read_text(encoding="utf-8")


def _finite(obj: Any) -> Any:
    """``obj`` with non-finite floats as ``None`` (JSON has no NaN; the browser's parser refuses it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class TokenGate:
    """Let a request through only with the token (header, cookie, or ``?token=`` on the page)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def _ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth.lower().startswith("bearer ") else None
        if self._ok(bearer) or self._ok(request.cookies.get(COOKIE)):
            await self.app(scope, receive, send)
            return
        if self._ok(request.query_params.get("token")):
            # Keep the token out of the address bar, history and Referer: a cookie from now on.
            response: Response = RedirectResponse(request.url.path, status_code=303)
            response.set_cookie(COOKIE, self.token.decode(), httponly=True, samesite="strict")
        else:
            response = PlainTextResponse(
                "this console needs its token: open the URL `cloud-aggregator console` printed "
                "(…/?token=…), or send Authorization: Bearer <token>\n",
                status_code=401,
            )
        await response(scope, receive, send)


class StreamGate:
    """Counts the open ``/events`` streams per client address and in all; refuses past the caps."""

    def __init__(self, per_client: int = STREAMS_PER_CLIENT, total: int = STREAMS_TOTAL) -> None:
        self.per_client, self.total = per_client, total
        self.open: dict[str, int] = {}
        self.refused = 0

    def enter(self, client: str) -> bool:
        # One event loop runs every route: no await between the check and the count.
        if sum(self.open.values()) >= self.total or self.open.get(client, 0) >= self.per_client:
            self.refused += 1
            return False
        self.open[client] = self.open.get(client, 0) + 1
        return True

    def leave(self, client: str) -> None:
        left = self.open.get(client, 0) - 1
        if left > 0:
            self.open[client] = left
        else:
            self.open.pop(client, None)


class EncodedView:
    """The view as the ``/events`` line every stream sends, encoded once per version of the source:
    N streams cost one encoding and one copy of it, not N."""

    def __init__(self, source: ViewSource) -> None:
        self.source = source
        self.version: tuple | None = None
        self.line = ""
        self.lock = anyio.Lock()

    async def get(self) -> tuple[tuple | None, str]:
        async with self.lock:
            version = self.source.version()
            if version != self.version or not self.line:
                data = await anyio.to_thread.run_sync(lambda: view_json(self.source))
                self.line = f"event: view\ndata: {json.dumps(_finite(data), allow_nan=False)}\n\n"
                self.version = version
            return self.version, self.line


def build_app(
    source: ViewSource,
    *,
    token: str | None = None,
    hosts: Sequence[str] | None = LOOPBACK_HOSTS,
    refresh_s: float = 1.0,
) -> Starlette:
    """The console app over ``source``.

    Parameters
    ----------
    source
        Where the fleet's view comes from (store and statuses).
    token
        Required on every request when given.
    hosts
        The Host headers served (on loopback: a page of another site cannot reach the console
        by DNS rebinding); ``None``: any (off loopback, where the token guards it).
    refresh_s
        How often ``/events`` checks for a change.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(source.view))
    registry.register(MachinesCollector(lambda: machines_of(source)))

    async def view(request: Request) -> Response:
        data = await anyio.to_thread.run_sync(lambda: view_json(source))
        return JSONResponse(_finite(data))

    async def metrics(request: Request) -> Response:
        body = await anyio.to_thread.run_sync(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    middleware = []
    if hosts is not None:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts)))
    if token is not None:
        middleware.append(Middleware(TokenGate, token=token))
    routes = [
        Route("/", _static("machines.html", "text/html")),
        Route("/common.js", _static("common.js", "text/javascript")),
        Route("/machines.js", _static("machines.js", "text/javascript")),
        Route("/learning", _static("index.html", "text/html")),
        Route("/console.js", _static("console.js", "text/javascript")),
        Route("/api/view", view),
        Route("/events", _events(source, refresh_s)),
        Route("/metrics", metrics),
    ]
    return Starlette(routes=routes, middleware=middleware)


def _static(name: str, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint serving the packaged page ``name``."""

    async def serve(request: Request) -> Response:
        return Response(_page(name), media_type=f"{media_type}; charset=utf-8")

    return serve


def _events(source: ViewSource, refresh_s: float) -> Callable[[Request], Awaitable[Response]]:
    """``/events``: the view as server-sent events, a line each time it changes (checked every
    ``refresh_s``), a keep-alive while it does not; a bounded number of streams per client."""
    gate, encoded = StreamGate(), EncodedView(source)

    async def events(request: Request) -> Response:
        client = request.client.host if request.client else "?"
        if not gate.enter(client):
            return PlainTextResponse(
                f"too many live streams (at most {gate.per_client} per client, {gate.total} in all): "
                "close another console tab, or retry later",
                status_code=429,
                headers={"Retry-After": "5"},
            )

        left = False

        def leave() -> None:  # once, whether the stream ran and ended or never started at all
            nonlocal left
            if not left:
                left = True
                gate.leave(client)

        body = _stream(source, encoded, refresh_s, leave)
        weakref.finalize(body, leave)  # a generator never started runs no ``finally``
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)

    return events


async def _stream(
    source: ViewSource, encoded: EncodedView, refresh_s: float, leave: Callable[[], None]
) -> AsyncIterator[str]:
    """One client's stream of the view's changes; ``leave`` frees its place when it ends."""
    try:
        last: tuple | None = None
        quiet = 0.0
        while True:
            if source.version() != last:
                last, line = await encoded.get()
                yield line
                quiet = 0.0
            elif quiet >= KEEPALIVE_S:
                yield ": keep-alive\n\n"
                quiet = 0.0
            await anyio.sleep(refresh_s)
            quiet += refresh_s
    finally:  # the client went away (or the server stops): its place is free again
        leave()

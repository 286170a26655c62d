"""The REST status API and the dashboard of one node.

    GET /            the dashboard (a self-contained page and its script and style, polling the JSON below)
    GET /status      name, model, round, phase, adapter version, last round, peers, rejections
    GET /history     one record per finished round
    GET /peers       per-peer counters and off-policy diagnostics
    GET /swarm       every peer this node knows of in the swarm (model, adapter, last round)
    GET /metrics     Prometheus text format (names prefixed ftis_)
    GET /healthz     200 while the node runs
    GET /openapi.json  the API's schema (no /docs page: it would need a CDN)

Served by uvicorn in a daemon thread, so the round loop stays plain synchronous code.
"""

from __future__ import annotations

import socket
import threading
import time
from importlib.resources import files

import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from node.serving.metrics import CONTENT_TYPE, NodeMetrics
from node.serving.status import NodeStatus

# The dashboard's files, served from the package: nothing outside the node is ever fetched.
STATIC = {"dashboard.js": "text/javascript", "charts.js": "text/javascript", "dashboard.css": "text/css"}
# The page draws network strings as text only; the policy is the second line of defence:
# no inline script, nothing from another origin.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def create_app(status: NodeStatus) -> FastAPI:
    # No /docs or /redoc: their pages load Swagger/ReDoc from a CDN and are blank offline.
    # The schema itself is served at /openapi.json.
    app = FastAPI(title="ftis-node", summary="Status of one ftis-node peer.", docs_url=None, redoc_url=None)
    package = files("node.serving")
    dashboard = package.joinpath("dashboard.html").read_text(encoding="utf-8")
    static = {name: package.joinpath(name).read_bytes() for name in STATIC}
    metrics = NodeMetrics(status)
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(dashboard, headers=headers)

    def serve(name: str):
        def handler() -> Response:
            return Response(static[name], media_type=STATIC[name], headers=headers)

        return handler

    for name in STATIC:
        app.add_api_route(f"/{name}", serve(name), methods=["GET"], include_in_schema=False)

    @app.get("/status")
    def get_status() -> dict:
        return status.snapshot()

    @app.get("/history")
    def get_history() -> list[dict]:
        return status.history_dump()

    @app.get("/peers")
    def get_peers() -> dict:
        return status.snapshot()["peers"]

    @app.get("/swarm")
    def get_swarm() -> dict:
        return status.swarm_dump()

    @app.get("/metrics", response_class=Response)
    def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "phase": status.snapshot()["phase"]}

    return app


class ApiServer:
    """uvicorn in a background thread; `port=0` picks a free port (see `.port`)."""

    def __init__(self, status: NodeStatus, host: str = "127.0.0.1", port: int = 0) -> None:
        # Bind the socket ourselves so the real port is known before uvicorn starts
        # and "port in use" surfaces here, as one clear error.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as err:
            self._sock.close()
            raise OSError(
                f"API port {host}:{port} is not free ({err.strerror}); pass --api-port 0 or another port"
            ) from None
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(create_app(status), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> ApiServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

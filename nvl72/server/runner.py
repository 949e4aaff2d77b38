"""Running the app under uvicorn: in the foreground (`nvl72 serve`) or in a thread (tests, benchmarks)."""
from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class ServerStartError(RuntimeError):
    """uvicorn did not come up (port taken, bad host) within the timeout."""


class ServerThread:
    """uvicorn in a background thread; port 0 picks a free port (read `.port` after `start()`)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, name="nvl72-http", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"HTTP server on {self.host}:{self.port} did not start within {timeout} s")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Blocking: serve until SIGINT/SIGTERM."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)

"""Serve an app with uvicorn: in the foreground (``hybrid serve``) or in a thread (tests, benchmarks)."""

from __future__ import annotations

import threading
import time


def run(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
        shutdown_timeout: float = 10.0) -> None:
    """Serve until SIGINT/SIGTERM; then uvicorn stops accepting, open connections get
    ``shutdown_timeout`` seconds, and the app's shutdown finishes or aborts what is left."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)


class ServerThread:
    """uvicorn in a background thread on ``host``; ``port=0`` picks a free port (see ``.port``).

    ``with ServerThread(app) as server: ... server.url ...`` starts it and waits until it listens,
    and stops it (gracefully) at the end."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 shutdown_timeout: float = 5.0):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=shutdown_timeout)
        self.server = uvicorn.Server(config)
        self.host = host
        self.port: int | None = None
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see uvicorn's log above)")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Running the fake backend in the foreground (`prefix-proxy fake-backend`); tests and benchmarks serve
`create_app` with `testbed.serving`."""

from __future__ import annotations

import uvicorn

from testbed.fakevllm.app import create_app
from testbed.fakevllm.config import FakeBackendConfig


def serve(config: FakeBackendConfig, host: str, port: int, *, log_level: str = "warning") -> None:
    """Serve until interrupted (what ``prefix-proxy fake-backend`` runs)."""
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level)

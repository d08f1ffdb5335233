"""What a vLLM server answers about itself: models, health, version, metrics, prefix-cache reset."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from testbed.fakevllm import responses as bodies
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.engine import FakeEngine
from testbed.fakevllm.metrics import CONTENT_TYPE


class ServerRoutes:
    """The operational routes: nothing here reads a request body."""

    def __init__(self, engine: FakeEngine, config: FakeBackendConfig) -> None:
        self.engine = engine
        self.config = config
        self.served_names = config.model_names

    async def models(self) -> JSONResponse:
        config = self.config
        return JSONResponse(bodies.model_list(self.served_names, config.model, config.max_model_len, bodies.now()))

    async def health(self) -> Response:
        return Response(status_code=200)

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": "0.0.0+fake"})

    async def metrics(self) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    async def reset_prefix_cache(self) -> Response:
        self.engine.cache.reset()  # refused (a no-op) while requests run, as in vLLM
        return Response(status_code=200)

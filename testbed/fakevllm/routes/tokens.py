"""The routes that only tokenize: ``/v1/embeddings``, and vLLM's ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from testbed.fakevllm import responses as bodies
from testbed.fakevllm.config import FakeBackendConfig
from testbed.fakevllm.embeddings import embed, to_base64, truncate_and_normalize
from testbed.fakevllm.engine import FakeEngine
from testbed.fakevllm.intake import embedding_inputs, read_model, tokenize_text
from testbed.fakevllm.protocol import EmbeddingRequest, Rejected, TokenizeRequest, error_response
from testbed.fakevllm.routes.checks import RequestChecks, rejected


class TokenRoutes:
    """Prompt in, token ids (or a deterministic embedding of them) out; no generation."""

    def __init__(self, checks: RequestChecks, engine: FakeEngine, config: FakeBackendConfig) -> None:
        self.checks = checks
        self.engine = engine
        self.config = config
        self.response_model = config.response_model

    async def embeddings(self, request: Request) -> Response:
        record = self.checks.new_record(request, "/v1/embeddings")
        try:
            record.body, req = await read_model(request, EmbeddingRequest)
            self.checks.check_model(req.model, record)
            inputs = embedding_inputs(self.engine.tokenizer, req.input)
        except Rejected as exc:
            return rejected(record, exc)
        data = []
        for index, ids in enumerate(inputs):
            vector = embed(json.dumps(ids).encode(), self.config.embedding_dim)
            if req.dimensions is not None and req.dimensions < len(vector):
                vector = truncate_and_normalize(vector, req.dimensions)
            encoded: list[float] | str = to_base64(vector) if req.encoding_format == "base64" else vector
            data.append({"index": index, "object": "embedding", "embedding": encoded})
        record.state = "completed"
        total = sum(len(ids) for ids in inputs)
        usage = {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0, "prompt_tokens_details": None}
        return JSONResponse(
            {
                "id": f"embd-{bodies.random_id()}",
                "object": "list",
                "created": bodies.now(),
                "model": self.response_model,
                "data": data,
                "usage": usage,
            }
        )

    async def tokenize(self, request: Request) -> Response:
        record = self.checks.new_record(request, "/tokenize")
        try:
            record.body, req = await read_model(request, TokenizeRequest)
            self.checks.check_model(req.model, record)
            prompt_text, add_special = tokenize_text(req)
        except Rejected as exc:
            return rejected(record, exc)
        ids = self.engine.tokenizer.encode(prompt_text, add_special_tokens=add_special)
        record.state = "completed"
        record.prompt_text = prompt_text
        record.prompt_token_ids.extend(ids)
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            tokens = body["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise TypeError("tokens must be a list of integers")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            return error_response(400, f"Invalid detokenize request: {exc}")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(tokens)})

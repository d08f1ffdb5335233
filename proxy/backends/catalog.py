"""What the upstream says about its models: the engine serving each and the context a request of it
may fill (vLLM's ``max_model_len``, llama-server's slot ``n_ctx``, Ollama's ``num_ctx``), cached;
exact prompt counts in the engine's own terms; and which llama-server slot holds a conversation
(:mod:`proxy.backends.engines`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import orjson

from proxy.backends.engines import (
    GENERIC,
    LLAMA_SERVER,
    OLLAMA,
    EngineKind,
    context_of,
    engine_of,
    info_context,
    ollama_context,
    ollama_name,
    prompts_unlisted,
    props_context,
    slot_holding,
    slot_markers,
)
from proxy.backends.pool import BackendPool
from proxy.backends.upstream import Upstream, read_response
from proxy.http import ProxyError

logger = logging.getLogger("prefix_proxy.models")
SHOW_TIMEOUT_S = 3.0
# The longest a slot search (``GET /slots`` on llama-server) is waited for; past it no slot is named.
SLOT_SEARCH_S = 1.0
# The longest an exact token count (``/tokenize``, and llama-server's ``/apply-template``) is waited for.
HELPER_TIMEOUT_S = 5.0


# A chat request's fields that change how vLLM renders its prompt, which its ``/tokenize`` takes too.
RENDERING_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents")


class ModelCatalog:
    def __init__(
        self, upstream: BackendPool, ttl_s: float = 300.0, retry_s: float = 10.0, *, ollama_num_ctx: int = 4096
    ) -> None:
        self._upstream = upstream
        self._ttl = ttl_s
        self._retry = retry_s
        self._ollama_num_ctx = ollama_num_ctx
        self._lengths: dict[str, int] = {}
        self._engines: dict[str, EngineKind] = {}
        # Names the engines resolve to a listed model other than the model's own (``listed``).
        self._aliases: dict[str, str] = {}
        # The one model of a llama-server in single-model mode, which runs it whatever name a
        # request gives (unlisted names go to every backend); None where no such model is listed.
        self._any_name: str | None = None
        self._fresh_until = 0.0
        # Contexts engines stated in refusing prompts past them (``learn_context``).
        self._refused_at: dict[str, int] = {}
        # Models whose llama-server lists no slot prompt text (its default), until when: a search by
        # text alone is not sent there again meanwhile.
        self._prompts_unlisted: dict[str, float] = {}

    async def max_model_len(self, model: str) -> int | None:
        """The context a request for ``model`` may fill at its engine, where known."""
        if time.monotonic() >= self._fresh_until:
            await self._refresh()
        return self._lengths.get(self.listed(model))

    def engine(self, model: str) -> EngineKind:
        """The engine serving ``model``, as last listed."""
        return self._engines.get(self.listed(model), GENERIC)

    def listed(self, model: str) -> str:
        """The listed model a request naming ``model`` runs on, as its engine reads the name: the name
        itself where listed; Ollama's spelling of a listed name (``llama3`` for ``llama3:latest``,
        any letter case); any name, for a llama-server serving one model. The name as given where
        none runs it (vLLM refuses a name it does not serve)."""
        if model in self._engines:
            return model
        alias = self._aliases.get(ollama_name(model))
        if alias is not None:
            return alias
        return self._any_name or model

    async def count_prompt_tokens(self, body: dict[str, Any], headers: dict[str, str]) -> int | None:
        """The exact prompt tokens from the engine, or None if it cannot say: vLLM's ``POST /tokenize``
        (chat template applied); llama-server's ``POST /apply-template`` then ``POST /tokenize``."""
        request: dict[str, Any] = {"model": body.get("model"), "messages": body.get("messages")}
        if body.get("tools"):
            request["tools"] = body["tools"]
        for field in RENDERING_FIELDS:
            if field in body:
                request[field] = body[field]  # the prompt rendered as the request will have it
        try:
            if self.engine(str(request["model"])) == LLAMA_SERVER:
                rendered = await self._post("/apply-template", request, headers)
                prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
                if not isinstance(prompt, str):
                    return None
                tokens = await self._post("/tokenize", {"content": prompt, "add_special": True}, headers)
                ids = tokens.get("tokens") if isinstance(tokens, dict) else None
                return len(ids) if isinstance(ids, list) else None
            answer = await self._post("/tokenize", request, headers)
            count = answer.get("count") if isinstance(answer, dict) else None
        except (ProxyError, ValueError, AttributeError, TypeError):
            return None
        return count if isinstance(count, int) else None

    async def slot_holding(
        self,
        messages: list[Any],
        *,
        model: str,
        key: str | None,
        headers: Mapping[str, str],
        idle_only: bool = False,
        sizes: Collection[int] = (),
    ) -> int | None:
        """The llama-server slot holding the conversation ``messages`` (``GET /slots`` on the backend
        ``key`` routes to, searched for its last user message and the reply before it), or None: not
        llama-server, a server started with ``--no-slots``, no slot found, or no answer. A request
        sent with that ``id_slot`` waits for the slot, if busy, rather than take another one and
        evict the conversation it holds (server-context.cpp ``get_available_slot``). ``idle_only``:
        only a slot that is not computing now (a request naming it does not wait). ``sizes``: or
        the slot that holds one of these many tokens (llama-server lists a slot's prompt text only
        with ``LLAMA_SERVER_SLOTS_DEBUG`` set, its size always)."""
        if self.engine(model) != LLAMA_SERVER:
            return None
        markers = slot_markers(messages)
        if not sizes and (not markers or self._prompts_unlisted.get(model, 0.0) > time.monotonic()):
            return None
        try:
            # Asked on a turn's way (and, with a shared store, before an answer is released): never
            # waited for past SLOT_SEARCH_S. llama-server answers it between decode steps.
            async with asyncio.timeout(SLOT_SEARCH_S):
                response = await self._upstream.open("GET", "/slots", headers=headers, root=True, key=key, model=model)
                raw = await self._upstream.read(response)
            if response.status_code != 200:
                return None
            slots = json.loads(raw)
        except (ProxyError, ValueError, TimeoutError):
            return None
        if not sizes and prompts_unlisted(slots):
            self._prompts_unlisted[model] = time.monotonic() + self._ttl
        return slot_holding(slots, markers, idle_only=idle_only, sizes=sizes)

    async def _post(self, path: str, request: dict[str, Any], headers: dict[str, str]) -> Any:
        """The engine's JSON answer to a helper request (``/tokenize``, ``/apply-template``), or None:
        an error status, or no answer within ``HELPER_TIMEOUT_S`` (it is asked on a turn's way, and
        the turn goes on with its estimate)."""
        try:
            async with asyncio.timeout(HELPER_TIMEOUT_S):
                response = await self._upstream.open(
                    "POST",
                    path,
                    content=orjson.dumps(request),
                    headers={**headers, "content-type": "application/json"},
                    root=True,
                    model=request.get("model"),
                )
                raw = await self._upstream.read(response)
        except TimeoutError:
            return None
        return json.loads(raw) if response.status_code == 200 else None

    async def _refresh(self) -> None:
        data = (await self._upstream.list_models()).data
        if data is None:
            urls = ", ".join(backend.upstream.base_url + "/models" for backend in self._upstream.backends)
            logger.warning(
                "could not read the upstream's models (GET %s): context lengths unknown until it answers", urls
            )
            self._fresh_until = time.monotonic() + self._retry
            return
        models = [m for m in data if isinstance(m, dict) and m.get("id") is not None]
        self._engines = {str(m["id"]): engine_of(m) for m in models}
        self._aliases = {ollama_name(name): name for name, kind in self._engines.items() if kind == OLLAMA}
        servers = [name for name, kind in self._engines.items() if kind == LLAMA_SERVER]
        self._any_name = servers[0] if len(servers) == 1 else None
        lengths = {str(m["id"]): length for m in models if (length := context_of(m)) is not None}
        unsaid = [name for name, kind in self._engines.items() if kind == OLLAMA and name not in lengths]
        if unsaid:
            found = await asyncio.gather(*(self._ollama_context(name) for name in unsaid))
            lengths.update(zip(unsaid, found, strict=True))
        for name, length in self._refused_at.items():
            if name in self._engines:
                lengths.setdefault(name, length)
        silent = [name for name in self._engines if name not in lengths]
        if silent:
            # A listing without the context (older llama-server builds, llamafile, TGI): what the
            # engine serving the model says of itself elsewhere.
            described = await asyncio.gather(*(self._described_context(name) for name in silent))
            lengths.update({name: n for name, n in zip(silent, described, strict=True) if n is not None})
        self._lengths = lengths
        self._fresh_until = time.monotonic() + self._ttl

    def learn_context(self, model: str, context: int) -> None:
        """The context an engine stated in refusing a prompt past it, for a model whose listing and
        self-description said none (an engine that said nothing is compacted before it from then on);
        never in place of what the engine lists."""
        name = self.listed(model)
        if name not in self._engines or name in self._lengths:
            return
        self._refused_at[name] = context
        self._lengths[name] = context

    async def _described_context(self, model: str) -> int | None:
        """The context a backend that lists ``model`` describes for itself (``described_context``);
        None where none does. Only a backend known to list the model is asked: another backend's
        context is not this model's."""
        kind = self._engines.get(model, GENERIC)
        for backend in self._upstream.backends:
            if backend.models is not None and model in backend.models:
                context = await described_context(backend.upstream, kind)
                if context is not None:
                    return context
        return None

    async def _ollama_context(self, model: str) -> int:
        """An Ollama model's ``num_ctx`` (``POST /api/show``), else the configured default."""
        for backend in self._upstream.backends:
            try:
                response = await backend.upstream.open(
                    "POST",
                    "/api/show",
                    content=orjson.dumps({"model": model}),
                    headers={**backend.upstream.auth_headers(None), "content-type": "application/json"},
                    root=True,
                    timeout_s=SHOW_TIMEOUT_S,
                )
                raw = await read_response(response)
                if response.status_code == 200:
                    found = ollama_context(json.loads(raw))
                    if found is not None:
                        return found
            except (ProxyError, ValueError):
                continue
        return self._ollama_num_ctx


# What an engine says of itself where its listing gives no context, by the engine's kind: llama-server's
# ``GET /props`` (older builds and llamafile list no n_ctx), TGI's ``GET /info`` (its listing is an
# unknown server's). Asked briefly, both at once, and remembered per backend for DESCRIBED_TTL_S
# (answer or none): readiness probes and model refreshes ask it again and again.
DESCRIBED_PATHS = {LLAMA_SERVER: ("/props",), GENERIC: ("/info", "/props")}
DESCRIBED_TIMEOUT_S = 1.0
DESCRIBED_TTL_S = 300.0


async def described_context(upstream: Upstream, kind: EngineKind) -> int | None:
    """The context the engine at ``upstream`` describes at its root, where its model listing does not:
    llama-server's ``GET /props`` (``default_generation_settings.n_ctx``), TGI's ``GET /info``
    (``max_total_tokens``). None where none answers with one, and for an engine of another kind."""
    paths = DESCRIBED_PATHS.get(kind, ())
    if not paths:
        return None
    known = upstream.described.get(kind)
    if known is not None and time.monotonic() - known[0] < DESCRIBED_TTL_S:
        return known[1]
    found = await asyncio.gather(*(_described_at(upstream, path) for path in paths))
    context = next((value for value in found if value is not None), None)
    upstream.described[kind] = (time.monotonic(), context)
    return context


async def _described_at(upstream: Upstream, path: str) -> int | None:
    read = props_context if path == "/props" else info_context
    try:
        response = await upstream.open(
            "GET", path, headers=upstream.auth_headers(None), root=True, timeout_s=DESCRIBED_TIMEOUT_S
        )
        raw = await read_response(response)
        return read(json.loads(raw)) if response.status_code == 200 else None
    except (ProxyError, ValueError):
        return None

"""Routes the proxy forwards without rewriting: completions, embeddings, models."""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app_state import ProxyState
from proxy.backends import LLAMA_SERVER, OLLAMA, limit_fields
from proxy.chat import (
    budget_for,
    budget_refused,
    completion_allowance,
    prompt_ceiling,
    spent_when_cut_short,
    tokens_per_event,
    usage_limits,
)
from proxy.config import BudgetSettings
from proxy.http import (
    ProxyError,
    RequestContext,
    UpstreamUnreachable,
    parse_json_object,
    read_body,
    require_model,
    validate_completion_request,
)
from proxy.openai import Usage, dumps
from proxy.protocols import with_upstream_usage
from proxy.routes.exchange import StreamingAnswer, UpstreamAnswer, Wire, respond, send, send_json, upstream_error
from proxy.routes.forward import api_endpoint, upstream_headers, whole_answer
from proxy.sessions import Reservation, StoreUnavailable, UsageLimit
from proxy.tenants import Tenant


async def completions(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes), tenant.name)
    validate_completion_request(body)
    body = state.tenants.cache_salted(tenant, body)
    ctx.model = body["model"]
    ctx.stream = bool(body.get("stream"))
    budget = await CompletionBudget.admit(state, tenant, body)
    await budget.reserve()
    client_wants_usage = True
    if ctx.stream:
        body, client_wants_usage = with_upstream_usage(body)
    try:
        answer = await send(
            state, request, ctx, COMPLETIONS, dumps(body), stream=ctx.stream, client_wants_usage=client_wants_usage
        )
    except ProxyError:
        await budget.settle(None, answered=False)
        raise
    if not isinstance(answer, StreamingAnswer):
        budget.completed(answer)  # a stream's ending is told when the stream ends
        await budget.record()
    return respond(state, ctx, answer, budget)


COMPLETIONS = Wire("/completions", answer_list="choices")
VLLM_COMPLETIONS_MAX_TOKENS = 16
EMBEDDINGS = Wire("/embeddings")
MODELS = Wire("/models")
# Engines whose completions run to the end of the context without max_tokens (llama.cpp's n_predict -1).
UNBOUNDED_ENGINES = (LLAMA_SERVER, OLLAMA)


class CompletionBudget:
    """The tenant's usage budget on ``/v1/completions`` (no session: the tenant's limit only), so
    that no route generates past it: reserved as the chat pipeline reserves (the prompt's ceiling,
    every completion of every prompt), settled to the backend's usage."""

    def __init__(
        self, state: ProxyState, tenant: str, budget: BudgetSettings, limits: list[UsageLimit], prompt: int, amount: int
    ) -> None:
        self._state, self._tenant, self._budget, self._limits = state, tenant, budget, limits
        self._prompt, self._amount = prompt, amount
        self._tokens_per_event = 1
        self._reservation: Reservation | None = None
        self._unreserved = False
        self._settlement: Coroutine[Any, Any, None] | None = None

    @classmethod
    async def admit(cls, state: ProxyState, tenant: Tenant, body: dict[str, Any]) -> CompletionBudget:
        model = str(body.get("model"))
        budget = budget_for(state.settings, model, tenant.budget)
        limits = usage_limits(budget, tenant.name, None)
        if not limits:
            return cls(state, tenant.name, budget, limits, 0, 0)  # no budget: nothing to size
        prompt = body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        # The prompt as JSON: at least one byte per token for text, and for token ids alike; vLLM's
        # prompt_embeds (--enable-prompt-embeds) too, a token being a row of hidden-size numbers.
        size = sum(len(dumps(part)) for part in (prompt, body.get("prompt_embeds")) if part is not None)
        ceiling = prompt_ceiling(size, prompts)
        # Without max_tokens vLLM's completions generate 16 tokens (its CompletionRequest's default);
        # llama-server's (and Ollama's) to the end of the context (n_predict -1), as vLLM's do with
        # an explicit null.
        context = await state.models.max_model_len(model)
        engine = state.models.engine(model)
        default = VLLM_COMPLETIONS_MAX_TOKENS if engine not in UNBOUNDED_ENGINES else None
        fields = limit_fields(engine)
        completion = completion_allowance(body, budget, context, engine_default=default, fields=fields) * prompts
        admitted = cls(state, tenant.name, budget, limits, ceiling, ceiling + completion)
        admitted._tokens_per_event = tokens_per_event(body)
        return admitted

    async def reserve(self) -> None:
        if not self._limits:
            return
        sessions = self._state.sessions
        try:
            reservation = await sessions.reserve(self._limits, self._amount, self._budget.window_s)
        except StoreUnavailable:
            self._unreserved = True  # admitted: the store's outage is never the client's
            return
        if not reservation.admitted:
            raise budget_refused(self._state.metrics, self._tenant, reservation)
        self._reservation = reservation

    # -- how the answer ended (proxy.routes.forward.AnswerEnding) --------------------------------

    def completed(self, answer: UpstreamAnswer) -> None:
        if isinstance(answer, StreamingAnswer):
            self._settlement = self.settle(answer.relay.usage, answered=True)
        else:  # the upstream's error spent nothing
            self._settlement = self.settle(answer.usage, answered=answer.ok)

    def cut_short(self, usage: Usage | None, events: int) -> None:
        self._settlement = self.settle_cut_short(usage, events * self._tokens_per_event)

    def failed(self, error: ProxyError | None) -> None:
        self._settlement = self.settle(None, answered=False)

    async def before_response(self) -> None:
        """Settled before the client has the answer's end: its next request finds the budget as
        this one left it."""
        await self.record()

    async def record(self) -> None:
        settlement, self._settlement = self._settlement, None
        if settlement is not None:
            await settlement

    async def settle(self, usage: Usage | None, *, answered: bool) -> None:
        """Charge what the backend reported; an answer without readable usage keeps its
        reservation, a request that got no answer gives it all back."""
        if usage is not None:
            await self._settle_to(usage.total_tokens)
        elif not answered:
            await self._settle_to(0)

    async def settle_cut_short(self, usage: Usage | None, tokens: int) -> None:
        """A stream that stopped short: what the backend reported, else the prompt and the tokens
        its events relayed could carry (``tokens_per_event`` each), never more than was reserved."""
        await self._settle_to(spent_when_cut_short(usage, self._prompt, tokens, self._amount))

    async def _settle_to(self, spent: int) -> None:
        reservation, self._reservation = self._reservation, None
        if self._unreserved:
            self._unreserved = False
            await self._state.sessions.charge_unreserved(self._limits, spent, self._budget.window_s)
        await self._state.sessions.settle(reservation, spent, self._budget.window_s)


async def embeddings(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    body = parse_json_object(raw)
    ctx.model = require_model(body)
    kept = state.tenants.without_deployment_fields(body)
    return await send_json(state, request, ctx, EMBEDDINGS, raw if kept is body else dumps(kept))


async def models(state: ProxyState, request: Request, ctx: RequestContext, tenant: Tenant) -> Response:
    if state.backends.single:
        return await send_json(state, request, ctx, MODELS, None, method="GET")
    return await merged_models(state, request, ctx)


async def merged_models(state: ProxyState, request: Request, ctx: RequestContext) -> Response:
    """Several backends: one list of every model any live backend serves to the caller's credentials."""
    ctx.mark_upstream_sent()
    listing = await state.backends.list_models(upstream_headers(state, request, ctx))
    ctx.upstream_done_at = time.perf_counter()
    if listing.data is None and listing.refusal is not None:
        return upstream_error(state, ctx, listing.refusal.status_code, listing.refusal.content)
    if listing.data is None:
        raise UpstreamUnreachable("no backend answered")
    body = dumps({"object": "list", "data": listing.data})
    return whole_answer(state, ctx, body, 200)


routes = [
    Route("/v1/completions", api_endpoint("completions", completions), methods=["POST"]),
    Route("/v1/embeddings", api_endpoint("embeddings", embeddings), methods=["POST"]),
    Route("/v1/models", api_endpoint("models", models), methods=["GET"]),
]

"""The engine behind a backend, told from what it serves, and read in its own terms.

Two engine families serve the OpenAI API the proxy fronts, and they differ where the proxy's
decisions depend on them (docs/engines.md):

- **vLLM** lists ``max_model_len`` per model in ``GET /v1/models`` (``owned_by: "vllm"``), counts a
  chat prompt exactly at ``POST /tokenize`` (chat template applied), and refuses a prompt past its
  context with 400 "This model's maximum context length is N tokens. However, you requested M ...".
- **llama.cpp's llama-server** (the engine inside Ollama) lists ``owned_by: "llamacpp"`` and, in
  ``meta``, ``n_ctx``: the context of one slot (``--ctx-size`` divided among ``--parallel`` slots),
  which is what one request may fill; its ``/props`` says the same as
  ``default_generation_settings.n_ctx``. It refuses past it with 400, ``type:
  "exceed_context_size_error"`` and ``n_prompt_tokens``, ``n_ctx`` in the error.
- **Ollama** fronts llama.cpp with its own API; its OpenAI listing (``owned_by: "library"`` or
  ``"ollama"``) names no context. The context a request gets is the model's ``num_ctx`` parameter
  when its Modelfile sets one (``POST /api/show``), else Ollama's default (``engines.ollama_num_ctx``;
  past it Ollama drops the start of the prompt rather than refusing it).

Pure: no I/O here; :class:`proxy.backends.catalog.ModelCatalog` asks, this module reads.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from proxy.openai import loads, message_text

EngineKind = Literal["vllm", "llama-server", "ollama", "openai-compatible"]
VLLM: EngineKind = "vllm"
LLAMA_SERVER: EngineKind = "llama-server"
OLLAMA: EngineKind = "ollama"
GENERIC: EngineKind = "openai-compatible"

_OWNERS: dict[str, EngineKind] = {"vllm": VLLM, "llamacpp": LLAMA_SERVER, "library": OLLAMA, "ollama": OLLAMA}


def refuses_answer_room(kind: EngineKind) -> bool:
    """Whether the engine refuses a prompt that leaves no room for the answer it asks for: vLLM
    does (prompt plus ``max_tokens`` past ``max_model_len`` is a 400), and so is any engine it cannot
    tell apart taken to do. llama-server refuses only a prompt that fills the slot's context
    (``n_tokens >= n_ctx``: server-context.cpp) and stops the answer where the context ends; a
    prompt it would take is not compacted for the answer's room."""
    return kind != LLAMA_SERVER


# The fields an engine reads for a completion's limit, the first present winning. vLLM reads
# ``max_completion_tokens or max_tokens``; llama-server ``n_predict``, then either alias in that order
# (server-schema.cpp; ``n_predict`` is read apart, see ``proxy.chat.budget``); Ollama's OpenAI API
# ``max_tokens`` alone (its documented request fields): there ``max_completion_tokens`` limits nothing,
# and a request with only it generates until the model stops.
OPENAI_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")
_LIMIT_FIELDS: dict[EngineKind, tuple[str, ...]] = {OLLAMA: ("max_tokens",)}


def limit_fields(kind: EngineKind) -> tuple[str, ...]:
    """The request fields ``kind`` reads for the most tokens a completion may take."""
    return _LIMIT_FIELDS.get(kind, OPENAI_LIMIT_FIELDS)


def engine_of(model: Any) -> EngineKind:
    """The engine that lists ``model`` (one entry of ``GET /v1/models``'s ``data``)."""
    if not isinstance(model, dict):
        return GENERIC
    owner = model.get("owned_by")
    if isinstance(owner, str) and owner.lower() in _OWNERS:
        return _OWNERS[owner.lower()]
    if _count(model.get("max_model_len")) is not None:
        return VLLM
    meta = model.get("meta")
    if isinstance(meta, dict) and "n_ctx_train" in meta:
        return LLAMA_SERVER
    return GENERIC


def context_of(model: Any) -> int | None:
    """The tokens one request may hold, as the listing says: vLLM's ``max_model_len``, llama-server's
    ``meta.n_ctx`` (per slot); None where it says nothing (Ollama, other servers)."""
    if not isinstance(model, dict):
        return None
    length = _count(model.get("max_model_len"))
    meta = model.get("meta")
    if length is None and isinstance(meta, dict):
        length = _count(meta.get("n_ctx"))
    return length


def props_context(props: Any) -> int | None:
    """llama-server's ``GET /props``: ``default_generation_settings.n_ctx`` (a slot's context)."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    return _count(settings.get("n_ctx")) if isinstance(settings, dict) else None


def info_context(info: Any) -> int | None:
    """Hugging Face TGI's ``GET /info``: ``max_total_tokens`` (a request's input and new tokens
    together, past which TGI refuses it)."""
    return _count(info.get("max_total_tokens")) if isinstance(info, dict) else None


_NUM_CTX = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)


def ollama_context(show: Any) -> int | None:
    """Ollama's ``POST /api/show``: the ``num_ctx`` its Modelfile parameters set, if any (the
    model's trained ``context_length`` is not what a request gets: Ollama's default is)."""
    parameters = show.get("parameters") if isinstance(show, dict) else None
    match = _NUM_CTX.search(parameters) if isinstance(parameters, str) else None
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ContextOverflow:
    """An engine's refusal of a prompt longer than its context: what it counted, where known."""

    prompt_tokens: int | None
    context: int | None


# How engines say a prompt is past their context, each with what it counted where it says so:
# (the pattern, the group of the prompt's tokens, the group of the context). vLLM (nested since
# 0.10.1, flat before: the same words), SGLang's two messages, TGI's validation errors. Each is the
# start of the engine's message: an error that quotes a client's input (pydantic's "input_value=...")
# holds whatever words the client chose, never at its start.
_OPENING = r"\A\s*(?:Input validation error:\s*)?"
_OVERFLOWS = (
    (
        re.compile(
            _OPENING + r"'max_tokens' or 'max_completion_tokens' is too large: \d+\. This model's maximum context "
            r"length is (\d+) tokens and your request has (\d+) input tokens"
        ),
        2,
        1,
    ),
    (
        re.compile(_OPENING + r"This model's maximum context length is (\d+) tokens\. However, your request has (\d+)"),
        2,
        1,
    ),
    (
        re.compile(
            _OPENING
            + r"This model's maximum context length is (\d+) tokens.*?(?:requested|you requested) (\d+) tokens",
            re.S,
        ),
        2,
        1,
    ),
    (
        re.compile(_OPENING + r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"),
        1,
        2,
    ),
    (
        re.compile(
            _OPENING
            + r"Requested token count exceeds the model's maximum context length of (\d+) tokens"
            + r".*?(\d+) tokens from the input",
            re.S,
        ),
        2,
        1,
    ),
    (
        re.compile(_OPENING + r"`inputs` tokens \+ `max_new_tokens` must be <= (\d+)\. Given: (\d+) `inputs` tokens"),
        2,
        1,
    ),
    (re.compile(_OPENING + r"`inputs` must have less than (\d+) tokens\. Given: (\d+)"), 2, 1),
)
# The same refusals where their numbers are not found (a release that words them otherwise).
_OVERFLOW_WORDS = re.compile(
    _OPENING
    + r"(?:This model's maximum context length|'max_tokens' or 'max_completion_tokens' is too large"
    + r"|The input \(\d+ tokens\) is longer than the model's context|Requested token count exceeds"
    + r"|`inputs` tokens \+)"
)
# How engines refuse a request they cannot take (a field they do not know, a template that cannot
# render it): 400 (vLLM, SGLang, llama-server), 422 (TGI). A prompt past the context may be a 413 too.
REFUSAL_STATUSES = frozenset({400, 422})
_CONTEXT_REFUSAL_STATUSES = REFUSAL_STATUSES | {413}


def error_of(raw: bytes) -> tuple[str, str] | None:
    """An engine's error answer read whatever its shape, as (message, type): OpenAI's nested
    ``{"error": {"message", "type"}}`` (vLLM since 0.10.1, llama-server), the flat ``{"object":
    "error", "message", "type"}`` (vLLM before, SGLang), ``{"error": "...", "error_type"}`` (TGI),
    FastAPI's ``{"detail": "..."}``; None where it holds no message."""
    body = _error_body(raw)
    return _message_of(body) if body is not None else None


def _error_body(raw: bytes) -> dict[str, Any] | None:
    """An error answer's JSON object, where it is one of a size an error has."""
    if len(raw) > 64 * 1024:
        return None
    try:
        body = loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _message_of(body: dict[str, Any]) -> tuple[str, str] | None:
    error = body.get("error")
    if isinstance(error, dict):
        message, kind = error.get("message"), error.get("type")
    elif isinstance(error, str):
        message, kind = error, body.get("error_type")
    else:
        message, kind = body.get("message", body.get("detail")), body.get("type")
    if not isinstance(message, str):
        return None
    return message, kind if isinstance(kind, str) else ""


def context_overflow(status: int, raw: bytes) -> ContextOverflow | None:
    """Whether an error answer is the engine refusing a prompt past its context (the words of
    vLLM, SGLang and TGI, llama-server's ``exceed_context_size_error``), or None for any other error."""
    body = _error_body(raw) if status in _CONTEXT_REFUSAL_STATUSES else None
    if body is None:
        return None
    error = body.get("error")
    if isinstance(error, dict) and error.get("type") == "exceed_context_size_error":
        return ContextOverflow(_count(error.get("n_prompt_tokens")), _count(error.get("n_ctx")))
    read = _message_of(body)
    if read is None:
        return None
    message = read[0]
    for pattern, prompt, context in _OVERFLOWS:
        found = pattern.match(message)
        if found is not None:
            return ContextOverflow(int(found.group(prompt)), int(found.group(context)))
    return ContextOverflow(None, None) if _OVERFLOW_WORDS.match(message) else None


def _count(value: Any) -> int | None:
    """A positive integer, or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# Characters of a message a slot's prompt is searched for (its start: a template may trim the ends),
# and the shortest message worth searching for (a "thanks" names no conversation).
MARKER_CHARS = 256
MIN_MARKER_CHARS = 24


def slot_markers(messages: list[Any]) -> list[str]:
    """What names a conversation in a llama-server slot's prompt (``GET /slots`` ``prompt``, the
    last request it served, rendered): its last user message and the reply before it. Not the last
    reply: a slot's prompt ends before what it generated. Empty where they are too short to tell
    conversations apart."""
    last_user = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if isinstance(messages[i], dict) and messages[i].get("role") == "user"
        ),
        None,
    )
    if last_user is None:
        return []
    picked = [messages[last_user]]
    if last_user and isinstance(messages[last_user - 1], dict) and messages[last_user - 1].get("role") == "assistant":
        picked.append(messages[last_user - 1])
    markers = [message_text(message).strip()[:MARKER_CHARS] for message in picked]
    return markers if all(len(marker) >= MIN_MARKER_CHARS for marker in markers) else []


def slot_holding(slots: Any, markers: list[str], *, idle_only: bool = False, sizes: Collection[int] = ()) -> int | None:
    """The llama-server slot (``GET /slots``) whose prompt holds every marker, or that holds one of
    ``sizes`` tokens (``n_prompt_tokens``: a request's prompt and completion, less one, once it is
    done); the longest such prompt where several do; None where none does, or the answer is not a
    slot list. llama-server lists a slot's prompt text only when started with
    ``LLAMA_SERVER_SLOTS_DEBUG=1`` in its environment; its size always. ``idle_only``: only a slot
    that is not computing (``is_processing``)."""
    if (not markers and not sizes) or not isinstance(slots, list):
        return None
    holding = []
    for slot in slots:
        if not isinstance(slot, dict) or (idle_only and slot.get("is_processing") is not False):
            continue
        number, prompt, size = slot.get("id"), slot.get("prompt"), slot.get("n_prompt_tokens")
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            continue
        if markers and isinstance(prompt, str) and prompt and all(marker in prompt for marker in markers):
            holding.append((len(prompt), number))
        elif isinstance(size, int) and size in sizes:
            holding.append((size, number))
    return max(holding)[1] if holding else None


def prompts_unlisted(slots: Any) -> bool:
    """Whether a ``GET /slots`` answer lists slots that served a request (``n_prompt_tokens``) but
    not their prompt text: llama-server on its defaults (it lists it with ``LLAMA_SERVER_SLOTS_DEBUG``)."""
    if not isinstance(slots, list):
        return False
    served = [slot for slot in slots if isinstance(slot, dict) and slot.get("n_prompt_tokens")]
    return bool(served) and not any(isinstance(slot.get("prompt"), str) and slot["prompt"] for slot in served)


def ollama_name(name: str) -> str:
    """An Ollama model's name as Ollama resolves it (server/routes.go ``getExistingName``, ``model.ParseName``):
    the host ``registry.ollama.ai``, the namespace ``library`` and the tag ``latest`` filled in where
    not given, compared in any letter case: ``llama3``, ``LLAMA3:latest`` and
    ``registry.ollama.ai/library/llama3:latest`` are one model."""
    parts = name.strip().lower().split("/")
    model, colon, tag = parts[-1].partition(":")
    namespace = parts[-2] if len(parts) >= 2 else "library"
    host = "/".join(parts[:-2]) if len(parts) >= 3 else "registry.ollama.ai"
    return f"{host}/{namespace}/{model}:{tag if colon and tag else 'latest'}"

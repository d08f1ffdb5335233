"""Configs nobody listed: drawn from the settings' schema itself, each either refused by `check-config` in
one line naming its key, or served as `serve` serves it without a traceback.

The standard (docs/issue47-config-errors.md): "config errors are one line naming the key and the fix,
and `check-config` finds every one that `serve` would". tests/test_config_checks.py lists the mistakes
someone thought of; this walks :class:`proxy.config.Settings` recursively and, for every field, draws
the edge values of its type and constraints (0, negatives, each bound and its neighbours, huge ints,
NaN and infinities, empty and odd strings, odd URLs, empty lists, duplicates, values outside a Literal,
nested sections, tenants, upstreams, rules), given in a YAML file, ``PREFIX_PROXY_*`` variables (nested
with ``__`` or a section as JSON) or flags. For each config:

- `check-config`'s check (:func:`proxy.preflight.check_settings`, in process) and `serve`'s loader
  (:func:`proxy.preflight.load_settings`) agree, and raise nothing but their problems;
- refused: every problem is one line naming its source and a key;
- accepted: the servers are built as `serve` builds them (:func:`proxy.serve.build_servers`: the
  addresses bound, the app, uvicorn with the inbound deadlines, the /metrics server) and run in a
  thread in front of the bundled fake vLLM (and a Redis of their own); three turns of a conversation
  (plain, streamed, plain), the health, readiness, models, metrics and operator's page routes, a
  reload (SIGHUP's) to a second drawn config, and one more turn. No answer is a 500, nothing is logged
  at ERROR with a traceback, no connection is dropped; a tenant's own key is never refused (401). A
  4xx or 5xx that is the configuration's documented answer (a budget, an unreachable upstream, 413) is
  fine.

Bounded for CI (100 configs, about 20 s on 2 cores); a longer run, which prints how many configs were
served and refused: ``CONFIG_PROPERTY_EXAMPLES=2000 pytest -q -s tests/test_config_properties.py``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import re
import threading
import time
import types
import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import annotated_types
import httpx
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from proxy.app_state import ProxyState
from proxy.cli import _flags, build_parser
from proxy.config import ENV_PREFIX, Settings
from proxy.config_sources import ConfigError
from proxy.observability import configure_logging
from proxy.preflight import check_settings, load_settings
from proxy.reload import reload_settings
from proxy.serve import Servers, build_servers, listen
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from testbed.serving import LiveServer, free_port
from tests.redis_server import PrivateRedis

EXAMPLES = int(os.environ.get("CONFIG_PROPERTY_EXAMPLES", "100"))

# Placeholders in drawn strings, replaced once the servers they name exist.
FAKE = "@FAKE@"  # the fake vLLM's port
REDIS = "@REDIS@"  # the private Redis's port
TMP = "@TMP@"  # a folder of this run's own

TOP_LEVEL = frozenset(Settings.model_fields)

# -- values: what each kind of field draws ---------------------------------------------------------------

# Strings whose meaning the schema does not say: what an operator might write there, right and wrong.
UPSTREAMS = [
    f"http://127.0.0.1:{FAKE}/v1",
    f"http://localhost:{FAKE}/v1/",
    f"HTTP://127.0.0.1:{FAKE}/v1",
    f" http://127.0.0.1:{FAKE}/v1 ",
    f"http://127.0.0.1:{FAKE}",
    f"http://user:secret@127.0.0.1:{FAKE}/v1",
    f"http://127.0.0.1:{FAKE}/v1/chat/completions",
    "http://127.0.0.1:1/v1",
    f"https://127.0.0.1:{FAKE}/v1",
    f"http://[::1]:{FAKE}/v1",
    f"http://127.0.0.1:{FAKE}/v1?x=1",
    f"http://127.0.0.1:{FAKE}/v1#top",
    f"127.0.0.1:{FAKE}/v1",
    f"http://:{FAKE}/v1",
    "http://127.0.0.1:0/v1",
    "http://127.0.0.1:99999/v1",
    "http://[::1/v1",
    "ftp://127.0.0.1/v1",
    "http://no-such-host.invalid/v1",
    "",
    " ",
]
HOSTS = [
    "127.0.0.1",
    "0.0.0.0",
    "localhost",
    "LOCALHOST",
    "::1",
    "::",
    "[::1]",
    "",
    " 127.0.0.1",
    "127.1",
    "999.1.1.1",
    "192.0.2.1",
    "::ffff:127.0.0.1",
    "fe80::1",
    "no-such-host.invalid",
]
REDIS_URLS = [
    f"redis://127.0.0.1:{REDIS}/0",
    f"redis://127.0.0.1:{REDIS}/15",
    f"redis://127.0.0.1:{REDIS}",
    f"redis://:pw@127.0.0.1:{REDIS}/0",
    f"redis://127.0.0.1:{REDIS}/0?socket_timeout=abc",
    f"redis://127.0.0.1:{REDIS}/0?db=3",
    f"rediss://127.0.0.1:{REDIS}/0",
    "redis://127.0.0.1:1/0",
    "unix:///nonexistent/redis.sock",
    f"redis://127.0.0.1:{REDIS}/x",
    "redis://",
    "http://127.0.0.1:6379",
    "redis://127.0.0.1:99999/0",
    "",
]
SENTINELS = [f"127.0.0.1:{REDIS}", "127.0.0.1:1", "[::1]:26379", "127.0.0.1", "127.0.0.1:0", "", "a:b:c"]
HEADER_NAMES = [
    "x-session-id",
    "X-Session-Id",
    "x-smg-routing-key",
    "",
    "bad header",
    "content-length",
    "authorization",
    "host",
    "transfer-encoding",
    "x-é",
]
ROUTE_PATTERNS = [
    "/v1/models",
    "/v1/chat/completions",
    "/fault_tolerance/*",
    "*",
    "",
    "no-slash",
    "/v1/[",
    "/a(b",
    "/v1/chat/completions/",
]
KEYS = ["sk-1", "sk-2", "sk 3", "", " ", " sk-1", "sk-1\n", "ключ", "é"]
MODEL_NAMES = ["fake-model", "FAKE-MODEL", "", "*", "other-model", "llama3:8b"]
NAMES = ["acme", "beta", "", " ", "a/b", "ключ", "acme "]
PATTERNS = [
    "T-[0-9]+",
    "Current time: [^\\n]+",
    "",
    "(",
    ".*",
    "^",
    "\\b",
    "(?P<x>T)-(?P<x2>[0-9]+)",
    "a{99999999999}",
    "x(?i)y",
    "(" * 2000 + ")" * 2000,
]
MARKERS = ["<t>", "</t>", "", "Current time:", "\n"]
STRINGS: dict[str, list[Any]] = {
    "upstream": UPSTREAMS,
    "host": HOSTS,
    "metrics_host": HOSTS,
    "redis_url": REDIS_URLS,
    "redis_sentinel_service": ["mymaster", "", " "],
    "key_prefix": ["prefix-proxy:", "", "{tag}:", "a b", "ключ:"],
    "path": [f"{TMP}/capture.jsonl", TMP, f"{TMP}/missing/capture.jsonl", "", f"{TMP}/capture dir/c.jsonl"],
    "kv_model": ["llama-3.1-8b", "LLAMA-3.1-8B", "", "llama-9b", " llama-3.1-8b"],
    "kv_config_json": [
        f"{TMP}/good.json",
        f"{TMP}/zero.json",
        f"{TMP}/strings.json",
        f"{TMP}/negative.json",
        f"{TMP}/huge.json",
        f"{TMP}/fractional.json",
        f"{TMP}/list.json",
        f"{TMP}/text.json",
        "/nonexistent/config.json",
        TMP,
        "",
    ],
    "kv_dtype": ["fp16", "FP8", "bf16", "", "fp4", "bf16 "],
    "endpoint": [f"http://127.0.0.1:{FAKE}", "", "not a url", f"127.0.0.1:{FAKE}"],
    "service_name": ["prefix-proxy", "", " "],
    "model": ["fake-model", "", "no-such-model"],
    "instruction": ["Summarize the conversation.", "", "{placeholder}", "%s", "{}"],
    "name": NAMES,
    "pattern": PATTERNS,
    "start_marker": MARKERS,
    "end_marker": MARKERS,
}
LISTS: dict[str, list[Any]] = {
    "upstreams": UPSTREAMS,
    "redis_sentinels": SENTINELS,
    "headers": HEADER_NAMES,
    "key_headers": HEADER_NAMES,
    "echo_headers": HEADER_NAMES,
    "admin_routes": ROUTE_PATTERNS,
    "denied_routes": ROUTE_PATTERNS,
    "allowed_routes": ROUTE_PATTERNS,
    "ungoverned_generation": ROUTE_PATTERNS,
}
# Numbers where a setting starts to act on this test's three short turns (a compaction, a budget).
NUMBERS: dict[str, list[Any]] = {
    "context_limit_tokens": [300, 600, 1200],
    "session_tokens_per_window": [200, 2000],
    "tenant_tokens_per_window": [200, 2000],
    "max_summary_tokens": [16],
    "repair_max_tokens": [16],
    "keep_last_turns": [1],
}
GENERIC_STRINGS = ["x", "", " ", "ключ", "a\nb", "x" * 300]
# model-config files kv_config_json may name (TMP/<name>.json).
MODEL_CONFIGS: dict[str, Any] = {
    "good": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64},
    "zero": {"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 64},
    "strings": {"num_hidden_layers": "2", "num_attention_heads": "4", "hidden_size": "64"},
    "negative": {"num_hidden_layers": -2, "num_attention_heads": 4, "hidden_size": 64},
    "huge": {"num_hidden_layers": 10**30, "num_attention_heads": 4, "hidden_size": 64},
    "fractional": {"num_hidden_layers": 2.5, "num_attention_heads": 4, "hidden_size": 64},
    "list": [1, 2],
}


BOUNDS = {
    annotated_types.Gt: "gt",
    annotated_types.Ge: "ge",
    annotated_types.Lt: "lt",
    annotated_types.Le: "le",
    annotated_types.MinLen: "min_length",
}


def _constraints(items: Any, found: dict[str, Any]) -> None:
    for item in items:
        if isinstance(item, FieldInfo):
            _constraints(item.metadata, found)
        elif type(item) in BOUNDS:
            found[BOUNDS[type(item)]] = getattr(item, BOUNDS[type(item)])


def _unwrap(annotation: Any, found: dict[str, Any]) -> tuple[Any, bool]:
    """The type under ``Annotated`` and ``| None`` (constraints gathered into ``found``), and
    whether None is allowed."""
    optional = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation, *extra = typing.get_args(annotation)
            _constraints(extra, found)
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            optional = optional or len(members) < len(typing.get_args(annotation))
            annotation = members[0]
        else:
            return annotation, optional


def int_edges(c: dict[str, Any], default: Any) -> list[Any]:
    low = c["gt"] + 1 if "gt" in c else c.get("ge")
    high = c["lt"] - 1 if "lt" in c else c.get("le")
    edges = [default] if isinstance(default, int) and not isinstance(default, bool) else []
    for bound in (low, high):
        if bound is not None:
            edges += [bound, bound + 1, bound - 1]
    edges += [1, 2, 0, -1, 2**31, 2**63, 10**30, "8", 8.0, 2.5, True]
    return list(dict.fromkeys(edges))


def float_edges(c: dict[str, Any], default: Any) -> list[Any]:
    edges: list[Any] = [default] if isinstance(default, float) else []
    for name in ("gt", "ge", "lt", "le"):
        if name in c:
            bound = float(c[name])
            edges += [bound, math.nextafter(bound, math.inf), math.nextafter(bound, -math.inf), bound + 1]
    edges += [0.5, 1.0, 1e-9, 0.0, -1.0, 1e9, 1e300, math.inf, -math.inf, math.nan, "0.5"]
    return list(dict.fromkeys(edges))


@functools.cache
def field_values(owner: type[BaseModel], name: str) -> st.SearchStrategy[Any]:
    field = owner.model_fields[name]
    found: dict[str, Any] = {}
    _constraints(field.metadata, found)
    return annotation_values(name, field.annotation, found, field.default)


def annotation_values(name: str, annotation: Any, found: dict[str, Any], default: Any) -> st.SearchStrategy[Any]:
    found = dict(found)
    base, optional = _unwrap(annotation, found)
    origin = typing.get_origin(base)
    options: list[st.SearchStrategy[Any]] = []
    if name in STRINGS and base is str:
        options.append(st.sampled_from(STRINGS[name]))
    elif origin is Literal:
        allowed = list(typing.get_args(base))
        options.append(st.sampled_from([*allowed, "bogus", str(allowed[-1]).upper(), "", False]))
    elif base is bool:
        options.append(st.sampled_from([True, False, "yes", "maybe"]))
    elif base is int:
        options.append(st.sampled_from([*NUMBERS.get(name, []), *int_edges(found, default)]))
    elif base is float:
        options.append(st.sampled_from(float_edges(found, default)))
    elif base is str:
        options.append(st.sampled_from([*([default] if isinstance(default, str) else []), *GENERIC_STRINGS]))
    elif base is SecretStr:
        options.append(st.sampled_from(KEYS))
    elif origin is list:
        (item,) = typing.get_args(base)
        items = st.sampled_from(LISTS[name]) if name in LISTS else annotation_values(name, item, {}, None)
        lists = st.lists(items, max_size=3)
        options += [lists, lists.filter(bool).map(lambda values: [*values, values[0]])]  # a duplicate
    elif origin is dict:
        _, item = typing.get_args(base)
        values = annotation_values(name, item, {}, None)
        options.append(st.dictionaries(st.sampled_from(MODEL_NAMES), values, max_size=2))
    elif isinstance(base, type) and issubclass(base, BaseModel):
        options.append(model_values(base))
    else:
        raise AssertionError(f"no values drawn for {name}: {annotation!r}: teach annotation_values its type")
    if optional:
        options.append(st.none())
    if base in (int, float, str, bool, SecretStr) or origin is Literal:
        options.append(st.sampled_from([[], {"x": 1}] if optional else [None, [], {"x": 1}]))  # another type
    return st.one_of(options)


@st.composite
def model_values(draw: st.DrawFn, model: type[BaseModel], most: int = 3) -> dict[str, Any]:
    """A section or a list item: its required keys, and up to ``most`` others, each at an edge."""
    fields = model.model_fields
    required = [n for n, f in fields.items() if f.is_required()]
    others = [n for n in fields if n not in required]
    chosen = [*required, *draw(st.lists(st.sampled_from(others), max_size=most, unique=True))]
    return {name: draw(field_values(model, name)) for name in chosen}


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], type[BaseModel]]]:
    """Every setting that is not a section, with the section that holds it (lists and maps of
    sections, tenants, rules, model_budgets, are leaves: drawn whole)."""
    found = []
    for name, field in model.model_fields.items():
        base, _ = _unwrap(field.annotation, {})
        if isinstance(base, type) and issubclass(base, BaseModel):
            found += _leaves(base, (*prefix, name))
        else:
            found.append(((*prefix, name), model))
    return found


LEAVES = _leaves(Settings)


@st.composite
def configs(draw: st.DrawFn, most: int = 5) -> dict[str, Any]:
    """A few settings anywhere in the tree, each at an edge of what its type allows."""
    chosen = draw(st.lists(st.sampled_from(LEAVES), max_size=most, unique_by=lambda leaf: leaf[0]))
    data: dict[str, Any] = {}
    for path, owner in chosen:
        section = data
        for part in path[:-1]:
            section = section.setdefault(part, {})
        section[path[-1]] = draw(field_values(owner, path[-1]))
    return data


# -- delivery: a YAML file, variables, flags ---------------------------------------------------------------

Delivery = Literal["file", "env", "env_json", "flag"]
FLAG_SETTINGS = ("host", "port", "upstream", "upstreams")


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _variables(path: tuple[str, ...], value: Any, nested: bool) -> dict[str, str]:
    if nested and isinstance(value, dict):
        found: dict[str, str] = {}
        for key, item in value.items():
            found.update(_variables((*path, key), item, nested))
        return found
    if value is None:
        return {}  # a variable cannot say None: left unset
    return {ENV_PREFIX + "__".join(path).upper(): _env_value(value)}


class Given:
    """A drawn config as the operator gives it: the file's text, the variables, the flags."""

    def __init__(self, data: dict[str, Any], deliveries: dict[str, Delivery], folder: Path) -> None:
        self.data = data
        self.file: dict[str, Any] = {}
        self.env: dict[str, str] = {}
        argv = ["check-config"]
        for key, value in data.items():
            how = deliveries.get(key, "file")
            if how == "flag" and key in FLAG_SETTINGS and _flag_ready(key, value):
                values = value if isinstance(value, list) else [value]
                for item in values:
                    argv += [f"--{'upstream' if key == 'upstreams' else key}", str(item)]
            elif how in ("env", "env_json") and value is not None:
                self.env.update(_variables((key,), value, nested=how == "env"))
            else:
                self.file[key] = value
        self.path = folder / "proxy.yaml"
        self.path.write_text(yaml.safe_dump(self.file, allow_unicode=True) if self.file else "")
        argv += ["--config", str(self.path)]
        self.flags = _flags(build_parser().parse_args(argv))

    def describe(self) -> str:
        return f"file {self.file!r}, variables {self.env!r}, flags { {k: v for k, v in self.flags.items() if v} }"


def _flag_ready(key: str, value: Any) -> bool:
    if key == "port":
        return isinstance(value, int) and not isinstance(value, bool)
    if key == "upstreams":
        return isinstance(value, list) and len(value) > 1 and all(isinstance(v, str) and v for v in value)
    return isinstance(value, str) and value != "" and not value.startswith("-")


deliveries = st.dictionaries(st.sampled_from(sorted(TOP_LEVEL)), st.sampled_from(["file", "env", "env_json", "flag"]))


def _placed(value: Any, places: dict[str, str]) -> Any:
    if isinstance(value, str):
        for mark, actual in places.items():
            value = value.replace(mark, actual)
        return value
    if isinstance(value, list):
        return [_placed(v, places) for v in value]
    if isinstance(value, dict):
        return {_placed(k, places): _placed(v, places) for k, v in value.items()}
    return value


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}
    for name in saved:
        del os.environ[name]
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in [k for k in os.environ if k.upper().startswith(ENV_PREFIX)]:
            del os.environ[name]
        os.environ.update(saved)


# -- the checks --------------------------------------------------------------------------------------------


def names_a_key(problem: str, given: Given) -> bool:
    """``FILE: key...: ...``, ``PREFIX_PROXY_KEY...: ...``, ``--flag: ...`` or ``key...: ...``."""
    rest = problem.removeprefix(f"{given.path}: ")
    if rest.startswith(ENV_PREFIX):
        variable = rest.split(":", 1)[0]
        return variable[len(ENV_PREFIX) :].lower().split("__")[0] in TOP_LEVEL or "unknown setting" in rest
    if rest.startswith("--"):
        return rest.split(":", 1)[0] in ("--host", "--port", "--upstream")
    head = re.match(r"[a-z_]+", rest)
    return head is not None and head.group(0) in TOP_LEVEL and rest[head.end() : head.end() + 1] in (".", "[", ":")


class Errors(logging.Handler):
    """Records at ERROR and above, and tracebacks at any level, from the proxy, uvicorn, asyncio and
    the libraries below them."""

    LOGGERS = ("", "prefix_proxy", "uvicorn", "uvicorn.error")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def tracebacks(self, expected: list[str]) -> list[str]:
        """What was logged at ERROR but ``expected`` (documented lines: a refused reload's problems)."""
        shown = []
        for record in self.records:
            text = record.getMessage()
            if any(line in text for line in expected):
                continue
            if record.name.startswith("opentelemetry") and not record.exc_info:
                continue  # no collector listens (its address is the operator's, not the config's)
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            shown.append(f"{record.name}: {text}")
        return shown


@contextlib.contextmanager
def proxy_logging(level: str) -> Iterator[None]:
    """``serve``'s logging (:func:`configure_logging` at ``log_level``), written to a buffer, and the
    proxy's logger as it was afterwards."""
    logger = logging.getLogger("prefix_proxy")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    configure_logging(level, io.StringIO())
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


SYSTEM = "You are a helpful assistant.\nCurrent time: 2024-05-01 10:00:00\nTicket T-123 <t>volatile</t>"
QUESTIONS = ["What is 2+2?", "And 3+3? " * 40, "Summarize our talk."]


class Client:
    """Requests to the served proxy; every answer checked against what no configuration may cause."""

    def __init__(self, http: httpx.Client, servers: Servers, settings: Settings, tolerant: bool) -> None:
        self.http = http
        self.url = _url(servers.sockets[0])
        self.metrics_url = _url(servers.sockets[1]) if len(servers.sockets) > 1 else self.url
        self.settings = settings
        # Inbound deadlines under a second may close a connection before it is answered: their answer.
        self.tolerant = tolerant
        self.problems: list[str] = []
        self.statuses: list[int] = []
        self.history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    def key(self) -> str | None:
        tenants = self.settings.tenants
        return tenants[0].api_key.get_secret_value() if tenants else "anything"

    def send(self, method: str, url: str, *, key: str | None = None, **options: Any) -> httpx.Response | None:
        headers = {"x-session-id": "prop-session", **options.pop("headers", {})}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        try:
            if options.pop("stream", False):
                with self.http.stream(method, url, headers=headers, **options) as response:
                    response.read()
            else:
                response = self.http.request(method, url, headers=headers, **options)
        except (UnicodeEncodeError, httpx.LocalProtocolError):
            return None  # the key cannot be sent at all (a client's refusal, not the proxy's answer)
        except httpx.TransportError as error:
            if not self.tolerant:
                self.problems.append(f"{method} {url}: {type(error).__name__}: {error}")
            return None
        self.statuses.append(response.status_code)
        if response.status_code == 500 or b"internal_error" in response.content:
            self.problems.append(f"{method} {url} -> {response.status_code}: {response.text[:500]}")
        return response

    def turn(self, stream: bool) -> None:
        question = QUESTIONS[(len(self.history) // 2) % len(QUESTIONS)]
        self.history.append({"role": "user", "content": question})
        body = {"model": "fake-model", "messages": self.history, "max_tokens": 16, "stream": stream}
        key = self.key()
        response = self.send("POST", f"{self.url}/v1/chat/completions", key=key, json=body, stream=stream)
        reply = "OK."
        if response is not None and response.status_code == 200 and not stream:
            reply = response.json()["choices"][0]["message"]["content"] or reply
        self.history.append({"role": "assistant", "content": reply})
        if self.settings.tenants and not _sendable(key):
            self.problems.append(f"tenants[0].api_key {key!r}: no client can present it")
        elif response is not None and response.status_code == 401 and self.settings.tenants:
            self.problems.append(f"a tenant's own key was refused (401): {response.text[:300]}")

    def side_routes(self) -> None:
        for path in ("/healthz", "/readyz", "/v1/models"):
            self.send("GET", self.url + path, key=self.key())
        metrics_key = self.settings.metrics_api_key
        metrics = self.send(
            "GET", self.metrics_url + "/metrics", key=metrics_key.get_secret_value() if metrics_key else None
        )
        for name in ("metrics_api_key", "admin_api_key"):
            configured: SecretStr | None = getattr(self.settings, name)
            if configured is not None and configured.get_secret_value() and not _sendable(configured):
                self.problems.append(f"{name} {configured.get_secret_value()!r}: no client can present it")
        if metrics is not None and metrics.status_code == 401 and metrics_key and _sendable(metrics_key):
            self.problems.append("/metrics refused its own metrics_api_key (401)")
        admin = self.settings.admin_api_key
        if self.settings.ui.enabled and admin is not None:
            page = self.send("GET", self.metrics_url + "/ui", key=admin.get_secret_value())
            if page is not None and page.status_code == 401 and _sendable(admin):
                self.problems.append("/ui refused the admin key (401)")


def _sendable(key: str | SecretStr | None) -> bool:
    """Whether a client can present ``key`` at all (Bearer, in an HTTP header: visible ASCII)."""
    text = key.get_secret_value() if isinstance(key, SecretStr) else key
    return bool(text) and text == text.strip() and all(" " <= c <= "~" for c in text)


def _url(sock: Any) -> str:
    host, port = sock.getsockname()[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _build(settings: Settings, load: Any) -> Servers:
    """``serve``'s servers for ``settings``, listening on ports the system picks: the configured
    addresses are bound first as ``serve`` binds them (:func:`proxy.serve.listen`), then let go (a
    port another process holds is ``serve``'s documented one line, no defect)."""
    addresses = [(settings.host, settings.port, "port")]
    if settings.metrics_port is not None:
        addresses.append((settings.metrics_host or settings.host, settings.metrics_port, "metrics_port"))
    for host, port, name in addresses:
        try:
            listen(host, port, name).close()
        except ConfigError as error:
            if not all("Address already in use" in problem for problem in error.problems):
                raise
    ports = {"port": 0, "metrics_port": 0 if settings.metrics_port is not None else None}
    return build_servers(settings.model_copy(update=ports), reload=load)


@contextlib.contextmanager
def running(servers: Servers) -> Iterator[None]:
    thread = threading.Thread(target=servers.run, name="proxy-under-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not servers.api.started:
            assert thread.is_alive() and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.005)
        yield
    finally:
        servers.api.should_exit = True
        thread.join(timeout=60)
        for sock in servers.sockets:
            sock.close()
        assert not thread.is_alive(), "serve did not stop"


# -- the property ------------------------------------------------------------------------------------------

TALLY: Counter[str] = Counter()
# One client for every example (each new one loads the system's CA certificates: 50 ms).
HTTP = httpx.Client(timeout=30)


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    folder = tmp_path_factory.mktemp("config-properties")
    for name, content in MODEL_CONFIGS.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    (folder / "text.json").write_text("not json")
    (folder / "capture dir").mkdir()
    fake = LiveServer(create_fake_app(FakeBackendConfig()), name="fake-vllm").start()
    redis = PrivateRedis(free_port()).start()
    yield {FAKE: str(fake.port), REDIS: str(redis.port), TMP: str(folder)}
    fake.stop()
    redis.stop()
    if TALLY:
        print(f"\nconfig properties: {dict(TALLY)}")


@pytest.fixture(autouse=True)
def no_proxy_variables() -> Iterator[None]:
    with environment({}):
        yield


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=configs(), how=deliveries, reloaded=configs(), ready=st.sampled_from([True, True, False]))
# What it found once (now refused in one line, or served), kept: tests/test_config_checks.py lists each.
@example(data={"canon": {"learned_apps_max": 0}}, how={}, reloaded={}, ready=True)  # was a 500
@example(data={"routing": {"key_headers": ["transfer-encoding"]}}, how={}, reloaded={}, ready=True)  # was 400s
@example(data={"upstream_api_key": "ключ"}, how={"upstream_api_key": "env"}, reloaded={}, ready=True)  # was 500s
@example(data={"upstreams": [f"http://127.0.0.1:{FAKE}/v1"] * 2}, how={}, reloaded={}, ready=True)  # a traceback
@example(data={"upstream_keepalive_s": math.inf}, how={}, reloaded={}, ready=True)  # was a 500
def test_a_drawn_config_is_refused_in_one_line_naming_its_key_or_served_without_a_traceback(
    places: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    data: dict[str, Any],
    how: dict[str, Delivery],
    reloaded: dict[str, Any],
    ready: bool,
) -> None:
    folder = tmp_path_factory.mktemp("drawn")
    if ready and not data.get("upstreams"):
        # A backend that answers: the drawn values are the only change to a config that serves.
        data.setdefault("upstream", f"http://127.0.0.1:{FAKE}/v1")
    sessions = data.get("sessions")
    if isinstance(sessions, dict) and "store" in sessions:
        # The Redis of this test's own, not the default address's (another's, or none).
        sessions.setdefault("redis_url", f"redis://127.0.0.1:{REDIS}/0")
    given_ = Given(_placed(data, places), how, folder)
    with environment(given_.env):
        try:
            lines, problems, _ = check_settings(str(given_.path), **given_.flags)
        except Exception as error:
            raise AssertionError(f"check-config raised {error!r} for {given_.describe()}") from error
        try:
            settings_ = load_settings(str(given_.path), **given_.flags)
            refused: list[str] = []
        except ConfigError as error:
            refused = error.problems
        except Exception as error:
            raise AssertionError(f"serve's loader raised {error!r} for {given_.describe()}") from error
        assert refused == problems, f"check-config and serve disagree on {given_.describe()}"
        for problem in problems:
            assert "\n" not in problem and names_a_key(problem, given_), (problem, given_.describe())
        if problems:
            TALLY["refused"] += 1
            return
        assert lines
        TALLY["served"] += 1
        serve_and_ask(given_, settings_, _placed(reloaded, places))


def serve_and_ask(given_: Given, settings_: Settings, reloaded: dict[str, Any]) -> None:
    def load() -> Settings:
        return load_settings(str(given_.path), **given_.flags)

    errors = Errors()
    tolerant = min(settings_.request_header_timeout_s, settings_.request_body_timeout_s, settings_.request_timeout_s)
    with proxy_logging(settings_.log_level):
        try:
            servers = _build(settings_, load)
        except ConfigError as error:
            raise AssertionError(f"check-config passed, serve refused: {error.problems}: {given_.describe()}") from None
        except Exception as error:
            raise AssertionError(f"serve raised {error!r} for {given_.describe()}") from error
        errors.attach()
        try:
            client = Client(HTTP, servers, settings_, tolerant=tolerant < 1.0)
            with running(servers):
                client.turn(stream=False)
                client.turn(stream=True)
                client.turn(stream=False)
                client.side_routes()
                # SIGHUP: the file now holds a second drawn config (the variables and flags stay).
                given_.path.write_text(yaml.safe_dump(reloaded, allow_unicode=True) if reloaded else "")
                _, reload_problems, _ = check_settings(str(given_.path), **given_.flags)
                state: ProxyState = servers.app.state.proxy
                try:
                    reload_settings(state, load)
                except Exception as error:
                    raise AssertionError(f"reload raised {error!r} to file {reloaded!r}") from error
                client.settings = state.settings
                client.turn(stream=False)
        finally:
            errors.detach()
    TALLY["statuses " + ",".join(str(s) for s in sorted(set(client.statuses)))] += 1
    found = client.problems + errors.tracebacks(reload_problems)
    assert not found, f"{given_.describe()}, reloaded to {reloaded!r}:\n" + "\n".join(found)

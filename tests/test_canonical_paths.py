"""One canonical path: every spelling of a route the proxy owns reaches that route (its pipeline:
budget, tenant salt, session) or a 404, never the pass-through route that would forward it past
them. Spellings come from ``bench.hostile_http.respell`` (also used by the fuzz suite): repeated
and trailing slashes, dot segments, percent-encoded letters, other letter case. Requests go over
a raw socket (``http.client`` sends the target as given), so no client tidies them first.
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.hostile_http import respell
from proxy.http.paths import InvalidPath, canonical_path
from tests.helpers import LiveServer

TENANTS = [{"name": "acme", "api_key": "sk-acme"}, {"name": "globex", "api_key": "sk-globex"}]
CHAT = {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
PIPELINES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/messages": {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
    "/v1/responses": {"model": "fake-model", "max_output_tokens": 8, "input": "x"},
}
ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions", "/v1/embeddings"]


def post(server: LiveServer, target: str, body: dict[str, Any], key: str = "sk-acme") -> tuple[int, bytes]:
    return request(server, "POST", target, body, key)


def request(
    server: LiveServer, method: str, target: str, body: dict[str, Any] | None = None, key: str = "sk-acme"
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"authorization": f"Bearer {key}", "x-api-key": key}
        if payload is not None:
            headers["content-type"] = "application/json"
        connection.request(method, target, body=payload, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@given(
    route=st.sampled_from([*ROUTES, "/v1/responses/resp_1/input_items", "/admin/tenants/acme/sessions"]),
    rng=st.randoms(use_true_random=False),
)
@settings(max_examples=400, deadline=None)
def test_every_spelling_is_made_the_routes_own(route: str, rng: random.Random) -> None:
    spelling, case_changed = respell(route, rng)
    # What the server hands the app: the target decoded once.
    canonical = canonical_path(unquote(spelling))
    assert canonical == route if not case_changed else canonical.lower() == route.lower() != canonical


# Paths as the server hands them over (decoded once): what is still encoded is a separator or a
# dot segment only to a server that decodes twice.
@pytest.mark.parametrize(
    "path",
    ["/v1/../../chat/completions", "/v1%2Fchat/completions", "/v1/chat%2fcompletions", "/v1\\chat/x", "/%2e%2e/x"],
)
def test_what_a_second_decoding_would_turn_into_a_route_is_refused(path: str) -> None:
    with pytest.raises(InvalidPath):
        canonical_path(path)


def test_a_twice_encoded_path_is_answered_400(make_proxy: Callable[..., LiveServer]) -> None:
    proxy = make_proxy(tenants=TENANTS)
    status, body = post(proxy, "/v1%252Fchat/completions", CHAT)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_path"


@pytest.fixture
def spent(make_proxy: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    """Tenants whose token budget is spent: every pipeline request is a 429."""
    yield make_proxy(tenants=TENANTS, budget={"tenant_tokens_per_window": 1})


def test_every_spelling_of_a_pipeline_route_meets_the_budget(spent: LiveServer) -> None:
    rng = random.Random(24)
    seen: dict[int, int] = {}
    for _ in range(120):
        route = rng.choice(list(PIPELINES))
        spelling, case_changed = respell(route, rng)
        status, body = post(spent, spelling, PIPELINES[route])
        seen[status] = seen.get(status, 0) + 1
        # The budget's 429, or a 404 for another letter case (another route to vLLM, and one
        # the proxy does not forward either); never an answer from the backend.
        assert status == (404 if case_changed else 429), (spelling, status, body[:200])
    assert seen.get(429, 0) > 60


def test_the_literal_spellings_of_the_issue(spent: LiveServer) -> None:
    for route, body in PIPELINES.items():
        for spelling in ("/" + route, route.replace("/v1/", "/v1//"), route + "/", route + "//", "/./" + route):
            assert post(spent, spelling, body)[0] == 429, spelling
        assert post(spent, route.upper(), body)[0] == 404


def test_every_spelling_of_completions_is_salted(
    make_proxy: Callable[..., LiveServer], fake_backend: LiveServer
) -> None:
    proxy = make_proxy(tenants=TENANTS)
    rng = random.Random(7)
    expected = None
    for _ in range(30):
        spelling, case_changed = respell("/v1/completions", rng)
        status, _ = post(proxy, spelling, {"model": "fake-model", "prompt": "Say hi", "max_tokens": 4})
        if case_changed:
            assert status == 404
            continue
        assert status == 200, spelling
        last = httpx.get(fake_backend.url + "/fake/requests", params={"limit": 1}).json()[-1]
        assert last["endpoint"] == "/v1/completions"
        salt = last["body"].get("cache_salt")
        assert salt and salt.startswith("pp-")
        expected = expected or salt
        assert salt == expected  # one tenant, one salt, whatever the spelling


def test_stored_responses_are_the_tenants_on_every_spelling(make_proxy: Callable[..., LiveServer]) -> None:
    proxy = make_proxy(tenants=TENANTS)
    acme = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-acme", max_retries=0)
    created = acme.responses.create(model="fake-model", input="hello", max_output_tokens=8)
    for spelling in (
        f"//v1/responses/{created.id}",
        f"/v1//responses/{created.id}/",
        f"/v1/responses/x/../{created.id}",
        f"/v1/responses/{created.id}/input_items",
    ):
        assert request(proxy, "GET", spelling, key="sk-globex")[0] == 404, spelling
        assert request(proxy, "DELETE", spelling, key="sk-globex")[0] == 404, spelling
    follow = {"model": "fake-model", "input": "more", "previous_response_id": created.id}
    for spelling in ("/v1/responses/", "//v1/responses", "/v1//responses"):
        assert post(proxy, spelling, follow, key="sk-globex")[0] == 404, spelling
    assert request(proxy, "GET", f"//v1/responses/{created.id}/")[0] == 200  # the owner's, any spelling


def test_admin_routes_match_in_any_case(make_proxy: Callable[..., LiveServer], fake_backend: LiveServer) -> None:
    proxy = make_proxy(tenants=TENANTS, admin_api_key="admin-key")
    before = len(httpx.get(fake_backend.url + "/fake/requests").json())
    for spelling in ("/Reset_prefix_cache", "/RESET_PREFIX_CACHE/", "//reset_prefix_cache"):
        # A tenant's key is not the admin key: the operator route refuses it, in every case.
        assert request(proxy, "POST", spelling, {})[0] in (401, 403), spelling
    assert len(httpx.get(fake_backend.url + "/fake/requests").json()) == before


@pytest.mark.parametrize("route", ["/invocations", "/v1/chat/completions/batch", "/cohere/v2/chat"])
def test_generation_outside_the_pipeline_is_no_way_around_it(make_proxy: Callable[..., LiveServer], route: str) -> None:
    """vLLM generates on these routes too (/invocations takes a chat body): with tenants they
    would skip the budget and the tenant's salt, so they are not forwarded unless allowed by name."""
    governed = make_proxy(tenants=TENANTS, budget={"tenant_tokens_per_window": 1})
    for spelling in (route, route + "/", "/" + route, route.upper()):
        status, body = post(governed, spelling, CHAT)
        assert status == 404, (spelling, body[:200])
    assert b"outside the proxy's pipeline" in post(governed, route, CHAT)[1]
    allowed = make_proxy(tenants=TENANTS, routes={"allowed_routes": [route]})
    assert b"outside the proxy's pipeline" not in post(allowed, route, CHAT)[1]

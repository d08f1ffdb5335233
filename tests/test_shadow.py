"""The shadow (docs/canonicalization.md): an app whose rewrites cost more than its requests as sent
stops being rewritten within a window of requests, tries again after a doubling back-off, and an
app whose rewrites pay keeps them. Against the fake vLLM, whose prefix cache counts prefill in
16-token blocks of the prompt it tokenized (proxy.enginemodel)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.app import create_app
from proxy.canon import Action, CanonResult
from proxy.config import Settings
from proxy.observability.digests import digest_prompt
from proxy.observability.shadow import RewriteShadow, ShadowSettings
from proxy.observability.shadowcache import FRAMING_TOKENS, ArrangementCache
from testbed.fakevllm import FakeBackendConfig
from testbed.fakevllm import create_app as create_fake_app
from tests.helpers import LiveServer, chat

PER_BYTE = 0.25
PROMPTS: list[int] = []
POLICY = "\n".join(f"Rule {i}: answer in the customer's language and cite the order number." for i in range(30))
CLOSING = "Closing notes:\n- be brief\n- never promise refunds\n- sign as the support desk"
SYSTEM = f"You are the support desk of a shop.\n\n{POLICY}\n\n{CLOSING}"


# -- the simulated cache -----------------------------------------------------------------------


def serve(cache: ArrangementCache, messages: list[dict[str, Any]]) -> tuple[int, int]:
    body = {"model": "m", "messages": messages}
    served = cache.serve(digest_prompt(body, "t"), messages, PER_BYTE)
    return served.prompt_tokens, served.cached_tokens


def test_an_append_only_conversation_hits_what_it_sent_and_the_reply_generated() -> None:
    cache = ArrangementCache()
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is order 12?"}]
    prompt, cached = serve(cache, turn)
    assert cached == 0 and prompt > 400
    # The client re-sends the reply the backend generated: cached too, as vLLM caches it.
    turn += [{"role": "assistant", "content": "On its way."}, {"role": "user", "content": "Thanks."}]
    prompt2, cached2 = serve(cache, turn)
    assert cached2 % 16 == 0
    assert prompt2 - cached2 <= 16 + FRAMING_TOKENS + 2  # the new question and the last partial block


def test_a_system_prompt_changed_at_its_end_still_hits_its_first_lines() -> None:
    cache = ArrangementCache()
    serve(cache, [{"role": "system", "content": SYSTEM + "\nNow: 10:00"}, {"role": "user", "content": "Hi"}])
    prompt, cached = serve(
        cache, [{"role": "system", "content": SYSTEM + "\nNow: 10:01"}, {"role": "user", "content": "Hi"}]
    )
    assert prompt - cached < 32  # the changed line, the question, a block's remainder
    _, cold = serve(cache, [{"role": "system", "content": "Now: 10:02\n" + SYSTEM}, {"role": "user", "content": "Hi"}])
    assert cold == 0  # changed at its first line: nothing before it to reuse


class EveryLink(ArrangementCache):
    """The cache with every prompt's links made at once (what ``_links`` defers): the reference."""

    __slots__ = ()

    def _links(self, prompt: Any) -> tuple[Any, bool]:
        from proxy.observability.digests import chain

        return chain(prompt), False


def test_links_made_only_once_a_prompt_reaches_its_system_messages_serve_the_same() -> None:
    """A system message that changes on every request (a clock) makes no link for each message of
    the history; what is served is what making every link serves, over conversations whose system
    messages change, come back (the same minute) and whose histories grow and fork. (A system text
    that comes back after ``PENDING_PROMPTS`` others finds its history no more: an estimate that
    errs towards the client's arrangement costing more.)"""
    import random

    rng = random.Random(5)
    # Bounds that forget nothing here: what each remembers is compared, not when each forgets.
    lazy, every = ArrangementCache(max_links=1 << 20), EveryLink(max_links=1 << 20)
    histories: list[list[dict[str, Any]]] = [[]]
    for request in range(400):
        history = list(rng.choice(histories))
        history += [{"role": "user", "content": f"question {request}"}]
        clock = rng.choice([request, request, request - 1])  # mostly new, sometimes the last one again
        messages = [{"role": "system", "content": f"{SYSTEM}\nNow: {clock}"}, *history]
        body = {"model": "m", "messages": messages}
        assert lazy.serve(digest_prompt(body, "t"), messages, PER_BYTE) == every.serve(
            digest_prompt(body, "t"), messages, PER_BYTE
        ), request
        histories.append([*history, {"role": "assistant", "content": f"answer {request}"}])
        del histories[:-6]


def test_the_cache_is_bounded_and_keeps_what_is_used() -> None:
    cache = ArrangementCache(max_links=64)
    system = {"role": "system", "content": SYSTEM}
    for i in range(200):
        serve(cache, [system, {"role": "user", "content": f"question {i}"}])
        assert len(cache) <= 64 + 40  # the bound, and one prompt's links (its system prompt's lines)
    _, cached = serve(cache, [system, {"role": "user", "content": "one more"}])
    assert cached > 300  # the system prompt every request used survived the generations


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Looks up the shop's records of kind {i} and returns them as a JSON list.",
            "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
        },
    }
    for i in range(8)
]


def test_tools_are_rendered_after_the_first_system_message() -> None:
    """As the engine's template lays them out (proxy.enginemodel: the tools follow the first system
    message's text): a change inside that text recomputes every tool after it, and new tools leave
    the text before them cached."""
    cache = ArrangementCache()
    tools_tokens = int(len(json.dumps(TOOLS, separators=(",", ":"))) * PER_BYTE)

    def served(system: str, tools: list[dict[str, Any]]) -> tuple[int, int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where is order 12?"}]
        prompt = digest_prompt({"model": "m", "messages": messages, "tools": tools}, "t")
        result = cache.serve(prompt, messages, PER_BYTE)
        return result.prompt_tokens, result.cached_tokens

    served(f"{SYSTEM}\nSession: 1", TOOLS)
    prompt, cached = served(f"{SYSTEM}\nSession: 2", TOOLS)
    assert prompt - cached > tools_tokens  # the changed line, then every tool
    assert cached >= int(len(SYSTEM) * PER_BYTE) - 16  # the lines before it
    prompt, cached = served(f"{SYSTEM}\nSession: 2", TOOLS[:4])
    assert cached >= int(len(SYSTEM) * PER_BYTE) - 16  # other tools: the text before them still hits


# -- the trials --------------------------------------------------------------------------------


def one_shot(question: str, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def moved_to_the_end(body: dict[str, Any], stamp: str) -> dict[str, Any]:
    """A wrong rewrite: the stable system prompt goes after a stamp that changes every request."""
    system, question = body["messages"]
    return {**body, "messages": [{"role": "system", "content": stamp}, system, question]}


def test_rewrites_that_cost_more_stop_within_the_window_and_try_again_after_a_doubling_backoff() -> None:
    shadow = RewriteShadow(ShadowSettings(window=4, backoff=3))
    outcomes = []
    for i in range(40):
        client = one_shot(f"question {i}")
        admission = shadow.admit("t", client)
        forwarded = moved_to_the_end(client, f"request {i}") if admission.rewrite else client
        verdict = shadow.account(admission, client, forwarded)
        outcomes.append("S" if verdict.stopped else ("R" if admission.rewrite else "-"))
    # A trial of 4 rewritten requests, then 3, 6, 12 as sent (the back-off doubles per lost trial).
    assert "".join(outcomes) == "RRRS" + "---" + "RRRS" + "-" * 6 + "RRRS" + "-" * 12 + "RRRS" + "---"


def test_a_trial_is_judged_on_the_requests_it_rewrote() -> None:
    """An app whose first rewrite comes late (what varies shows itself only after a few requests:
    a LangGraph agent's clock and retrieved context, two requests a turn with its tool loop) is not
    judged on that first rewrite with the as-sent requests before it: its window begins with the
    first request it changed. Before, the trial stopped on the first rewrite, whose cost (the move)
    comes before its gain (the next turn), and the run cost more than direct."""
    shadow = RewriteShadow(ShadowSettings(window=4, backoff=3))
    outcomes = []
    for i in range(20):
        client = one_shot(f"question {i}")
        admission = shadow.admit("t", client)
        # A copy, as the canonicalizer forwards a request it did not change.
        forwarded = moved_to_the_end(client, f"request {i}") if admission.rewrite and i >= 10 else dict(client)
        verdict = shadow.account(admission, client, forwarded)
        outcomes.append("S" if verdict.stopped else ("R" if admission.rewrite else "-"))
    # Ten requests rewritten to nothing, then a rule that costs: judged after four of its requests.
    assert "".join(outcomes) == "R" * 10 + "RRRS" + "---" + "RRR"


def test_rewrites_that_pay_are_kept() -> None:
    shadow = RewriteShadow(ShadowSettings(window=4, backoff=3))
    for i in range(30):
        # The client puts a clock first; the rewrite moves it after the stable prompt.
        client = one_shot(f"question {i}", system=f"Now: 10:{i:02d}\n{SYSTEM}")
        admission = shadow.admit("t", client)
        assert admission.rewrite
        forwarded = {
            **client,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "system", "content": f"Now: 10:{i:02d}"},
                client["messages"][1],
            ],
        }
        verdict = shadow.account(admission, client, forwarded)
        assert not verdict.stopped
        if i:
            assert verdict.extra_tokens < -300  # the whole system prompt saved


def conversation(
    shadow: RewriteShadow,
    system: str,
    turns: int,
    rewrite: Callable[[list[dict[str, Any]], int], list[dict[str, Any]]],
    *,
    tag: str,
) -> Iterator[tuple[bool, int, int]]:
    """One conversation of short turns with ``TOOLS``; per request whether it went rewritten, the
    rewrite's extra tokens and the verdict's stop."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"{tag} question {turn}: and order {turn}?"}]
        client = {"model": "m", "messages": messages, "tools": TOOLS}
        admission = shadow.admit("t", client)
        forwarded = {**client, "messages": rewrite(messages, turn)} if admission.rewrite else client
        verdict = shadow.account(admission, client, forwarded)
        yield admission.rewrite, verdict.extra_tokens, verdict.stopped
        messages = [*messages, {"role": "assistant", "content": f"Done {turn}."}]


def stamped_before_last_user(messages: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    """The system prompt's first line moved before the last user message, in a block the next turn
    no longer carries there: each turn recomputes the previous question and answer (a few tokens)."""
    system, *rest = messages
    environment, _, stable = system["content"].partition("\n")
    moved = {"role": "system", "content": f"{environment}\nTurn: {turn}"}
    return [{**system, "content": stable}, *rest[:-1], moved, rest[-1]]


def test_a_rewrite_that_saves_each_new_conversation_its_prompt_is_kept_though_later_turns_cost() -> None:
    """The coding agents' bet: the per-session line moved, every new conversation reuses the system
    prompt and the tools the first one cached; later turns pay a few tokens each. Judged on the
    whole trial, not on its last window, where only the costs are left."""
    shadow = RewriteShadow(ShadowSettings(window=4, backoff=3))
    sessions = [
        conversation(shadow, f"Session: {session * 7919}\n{SYSTEM}", 12, stamped_before_last_user, tag=f"s{session}")
        for session in range(4)
    ]
    seen = [step for steps in zip(*sessions, strict=True) for step in steps]  # in flight together
    assert all(rewritten and not stopped for rewritten, _, stopped in seen)
    extras = [extra for _, extra, _ in seen]
    assert sum(extras) < -1000  # it pays
    # ... though a window of later turns costs more than a block: a sliding window would stop it.
    assert sum(extras[8:12]) > 16


def test_a_conversation_held_rewritten_stays_so_past_the_backoff_until_staying_costs_its_history() -> None:
    """Rewrites stopped: a conversation of short turns the backend holds rewritten stays rewritten
    after the back-off is over (a new conversation went as sent meanwhile), and goes as sent only
    once staying has cost what switching costs (its history, short here)."""
    shadow = RewriteShadow(ShadowSettings(window=2, backoff=1))
    held = conversation(shadow, f"Notes: none\n{SYSTEM}", 14, stamped_before_last_user, tag="a")
    seen = []
    for rewritten, extra, stopped in held:
        seen.append((rewritten, extra))
        if stopped:  # nothing to gain (one conversation): the trial is lost
            newcomer = next(conversation(shadow, f"Notes: none\n{SYSTEM}", 1, stamped_before_last_user, tag="b"))
            assert not newcomer[0]  # as sent: the back-off (one request) is over with it
            stop = len(seen)
    switched = [rewritten for rewritten, _ in seen].index(False)
    assert switched > stop + 1  # kept past the back-off
    assert not any(rewritten for rewritten, _ in seen[switched:])
    assert sum(extra for _, extra in seen[stop:switched]) >= seen[switched][1]  # staying cost the switch


def test_a_conversation_held_rewritten_switches_once_staying_has_cost_its_history() -> None:
    """A rule that costs the whole prompt on every turn (a changing stamp first): the conversation in
    flight when rewrites stop goes as sent after about a history's worth, not to its end."""
    shadow = RewriteShadow(ShadowSettings(window=2, backoff=1))

    def stamp_first(messages: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
        return [{"role": "system", "content": f"Request {turn}"}, *messages]

    seen = list(conversation(shadow, SYSTEM, 24, stamp_first, tag="a"))
    stopped = next(i for i, (_, _, stop) in enumerate(seen) if stop)
    rewritten = [r for r, _, _ in seen]
    switched = rewritten.index(False)
    assert switched > stopped + 1  # kept a while: switching costs the history
    assert not any(rewritten[switched:])  # then as sent to its end
    held = sum(extra for _, extra, _ in seen[stopped + 1 : switched])
    history = seen[switched][1]  # what the switch cost: the forwarded layout's miss on the client's
    assert held <= 2 * max(history, max(extra for _, extra, _ in seen))


def test_apps_are_bounded() -> None:
    shadow = RewriteShadow(ShadowSettings(max_apps=3))
    for i in range(10):
        body = {**one_shot("q"), "model": f"model-{i}"}
        shadow.account(shadow.admit("t", body), body, body)
    assert len(shadow) == 3


def test_an_app_is_a_template_recognized_through_its_varying_lines() -> None:
    """Two templates of one tenant's model are two apps: one's lost trial leaves the other rewritten."""
    shadow = RewriteShadow(ShadowSettings(window=4, backoff=3))
    other = "\n".join(f"Step {i}: translate the text into formal French." for i in range(20))
    for i in range(12):
        client = one_shot(f"question {i}", system=f"{SYSTEM}\nRequest id: {i * 7919}")
        admission = shadow.admit("t", client)
        shadow.account(admission, client, moved_to_the_end(client, f"request {i}") if admission.rewrite else client)
        translation = one_shot(f"text {i}", system=f"Now: {i}\n{other}")
        admitted = shadow.admit("t", translation)
        assert admitted.rewrite
        shadow.account(admitted, translation, translation)
    assert not shadow.admit("t", one_shot("again", system=f"{SYSTEM}\nRequest id: 1")).rewrite
    assert len(shadow) == 2


# -- through the proxy, against the fake vLLM ----------------------------------------------------


def misplacing(apply: Callable[[dict[str, Any], str], CanonResult]) -> Callable[[dict[str, Any], str], CanonResult]:
    """A deliberately wrong rule: the system prompt's last paragraph (stable) goes into a system
    message right before the last user message, on every request, wherever the conversation had
    it before. Each turn then recomputes the previous question and answer."""

    def apply_wrongly(body: dict[str, Any], tenant: str) -> CanonResult:
        result = apply(body, tenant)
        messages = list(result.body["messages"])
        head, separator, tail = messages[0]["content"].rpartition("\n\n")
        messages[0] = {**messages[0], "content": head + separator}
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages.insert(last_user, {"role": "system", "content": tail})
        return dataclasses.replace(
            result,
            body={**result.body, "messages": messages},
            actions=[*result.actions, Action("volatile_moved", "wrong_rule")],
        )

    return apply_wrongly


@pytest.fixture
def backends() -> Iterator[list[LiveServer]]:
    servers = [LiveServer(create_fake_app(FakeBackendConfig())).start() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


def proxy_for(backend: LiveServer, *, shadow: bool, wrong_rule: bool) -> LiveServer:
    settings = Settings(upstream=backend.url + "/v1")
    canon = settings.canon.model_copy(update={"shadow": settings.canon.shadow.model_copy(update={"enabled": shadow})})
    app = create_app(settings.model_copy(update={"canon": canon}))
    if wrong_rule:
        canonicalizer = app.state.proxy.canonicalizer
        canonicalizer.apply = misplacing(canonicalizer.apply)
    return LiveServer(app).start()


def converse(target: LiveServer, system: Callable[[int], str], turns: int, sessions: int) -> list[tuple[int, str]]:
    """``sessions`` conversations of ``turns`` turns, one after the other; per request the prefill
    the backend reported and the proxy's actions (the prompt tokens in ``PROMPTS``)."""
    seen = []
    for session in range(sessions):
        messages: list[dict[str, Any]] = [{"role": "system", "content": system(session)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Session {session}, question {turn}: where is order {turn}?"})
            response = chat(target, messages, max_tokens=24, headers={"x-session-id": f"s{session}"})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            seen.append((usage["prompt_tokens"] - cached, response.headers.get("x-prefix-proxy-actions", "")))
            PROMPTS.append(usage["prompt_tokens"])
            messages.append(response.json()["choices"][0]["message"])
    return seen


def converse_through(backend: LiveServer, *, shadow: bool, turns: int, sessions: int) -> list[tuple[int, str]]:
    proxy = proxy_for(backend, shadow=shadow, wrong_rule=True)
    try:
        return converse(proxy, lambda s: SYSTEM, turns, sessions)
    finally:
        proxy.stop()


def test_a_wrong_rule_stops_within_the_window_and_its_regret_is_bounded(backends: list[LiveServer]) -> None:
    turns, sessions = 12, 4
    direct = converse(backends[0], lambda s: SYSTEM, turns, sessions)
    guarded = converse_through(backends[1], shadow=True, turns=turns, sessions=sessions)
    unguarded = converse_through(backends[2], shadow=False, turns=turns, sessions=sessions)
    settings = Settings().canon.shadow
    actions = [a for _, a in guarded]
    stopped = [i for i, a in enumerate(actions) if "rewrites_stopped" in a]
    assert stopped and stopped[0] < settings.window + 2, actions  # the first trial is judged at its window
    # The conversation the backend holds rewritten stays so (a switch would cost its history);
    # the next one goes as sent, and the next trial starts with a new conversation after the back-off.
    as_sent = [i for i, a in enumerate(actions) if "forwarded_as_sent:shadow" in a]
    assert as_sent and as_sent[0] == turns
    restarted = [i for i, a in enumerate(actions) if "rewrite_trial_started" in a]
    assert restarted and restarted[0] % turns == 0 and restarted[0] >= as_sent[0] + settings.backoff_requests
    # A request as sent is the client's, byte for byte: no rewrite on it.
    assert all("volatile_moved" not in a for a in actions if "forwarded_as_sent" in a)

    direct_prefill = sum(p for p, _ in direct)
    regret = sum(p for p, _ in guarded) - direct_prefill
    unguarded_regret = sum(p for p, _ in unguarded) - direct_prefill
    # Unguarded, the rule costs on every turn but a conversation's first two.
    worse = sum(1 for (t, _), (d, _) in zip(unguarded, direct, strict=True) if t > d + 16)
    assert worse >= sessions * (turns - 2)
    # Guarded, each lost trial costs at most its window of requests, and the two switches of
    # arrangement around it (each at most a prompt: the history laid out the other way).
    worst_turn = max(t - d for (t, _), (d, _) in zip(unguarded, direct, strict=True))
    assert regret <= len(stopped) * (turns * worst_turn + 2 * max(PROMPTS))
    assert regret < unguarded_regret
    print(
        f"\ndirect {direct_prefill} prefill tokens over {len(direct)} requests; wrong rule unguarded "
        f"+{unguarded_regret}, guarded +{regret} ({len(stopped)} trial(s) lost)"
    )


def test_rewrites_that_pay_keep_being_made(backends: list[LiveServer]) -> None:
    """A clock at the top of the system prompt (Dify's sys.timestamp): moving it pays on every request."""
    direct_backend, proxied_backend = backends[:2]

    def clocked(session: int) -> str:
        return f"Current time: 2024-05-01 10:{session:02d}:{7 * session % 60:02d}\n{SYSTEM}"

    direct = converse(direct_backend, clocked, 4, 8)
    proxy = proxy_for(proxied_backend, shadow=True, wrong_rule=False)
    try:
        through = converse(proxy, clocked, 4, 8)
    finally:
        proxy.stop()
    assert not any("forwarded_as_sent" in a or "rewrites_stopped" in a for _, a in through)
    assert any("volatile_moved" in a for _, a in through)
    assert sum(p for p, _ in through) < sum(p for p, _ in direct)


def test_a_digest_resumed_after_changed_system_messages_equals_one_made_whole() -> None:
    """``digest_after_lead``: a history resumed after system messages that changed (in size too)
    gives the digest that digesting the prompt whole gives, its chain included."""
    import random

    from proxy.observability.digests import chain, digest_after_lead

    rng = random.Random(3)
    previous = None
    history: list[dict[str, Any]] = []
    sent = 0  # the history messages the previous prompt carried
    for request in range(60):
        history = [*history, {"role": "user", "content": f"q{request}" * rng.randint(1, 3)}]
        lead = rng.choice([1, 1, 2])
        systems = [{"role": "system", "content": f"{SYSTEM}\nNow: {'9' * rng.randint(1, 3)}"} for _ in range(lead)]
        body = {"model": "m", "messages": [*systems, *history]}
        resumed = digest_after_lead(body, "t", lead, previous, sent)
        whole = digest_prompt(body, "t", system_count=lead)
        assert (resumed.digests, resumed.ends, resumed.roles) == (whole.digests, whole.ends, whole.roles), request
        assert (resumed.system_count, resumed.system_lines) == (whole.system_count, whole.system_lines)
        assert chain(resumed) == chain(whole)
        previous, sent = resumed, len(history)
        history = [*history, {"role": "assistant", "content": f"a{request}"}]

"""Session inference resumed from a conversation's last request (``SessionService._held``): the
pairs the session still holds are neither looked up nor recorded again, and every request is
attributed exactly as a service that looks every pair up attributes it, whatever conversations
fork, regenerate, slide, take each other's pairs or name their session."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import SessionSettings
from proxy.observability.metrics import Metrics
from proxy.openai import Continuations
from proxy.openai.usage import Usage
from proxy.sessions.memory import MemorySessionStore
from proxy.sessions.service import SessionService

Messages = list[dict[str, Any]]


class CountingStore(MemorySessionStore):
    looked_up = 0

    async def lookup(self, tenant: str, fingerprints: list[int]) -> tuple[list[str | None], dict[str, float]]:
        self.looked_up += len(fingerprints)
        return await super().lookup(tenant, fingerprints)


def _chat(seed: int, turns: int) -> Messages:
    messages: Messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {seed % 3}-{turn}"})
        messages.append({"role": "assistant", "content": f"answer {seed}-{turn}"})
    messages.append({"role": "user", "content": f"question {seed % 3}-{turns}"})
    return messages


_steps = st.lists(
    st.tuples(
        st.sampled_from(["grow", "grow", "grow", "fork", "regenerate", "slide", "copy", "named", "title"]),
        st.integers(0, 3),
        st.integers(0, 2),
    ),
    min_size=3,
    max_size=16,
)


def _requests(steps: list[tuple[str, int, int]]) -> list[tuple[Messages, str | None, str]]:
    """(messages, the session named, the reply): three conversations that share openings (their
    first questions repeat by seed), grow, fork, regenerate a reply, slide, copy another's history
    (taking its pairs) and sometimes name a session or send a side task."""
    turns = [1, 1, 1]
    out: list[tuple[Messages, str | None, str]] = []
    for number, (kind, amount, which) in enumerate(steps):
        seed = which
        if kind == "grow":
            turns[seed] += amount + 1
        messages = _chat(seed, turns[seed])
        named = None
        if kind == "fork":
            messages = [*messages[:-2], {"role": "assistant", "content": f"another {amount}"}, messages[-1]]
        elif kind == "regenerate":
            messages = [*messages[:-2], messages[-1]]
        elif kind == "slide":
            messages = messages[:1] + messages[1 + 2 * min(amount, turns[seed] - 1) :]
        elif kind == "copy":
            messages = _chat((seed + 1) % 3, turns[(seed + 1) % 3])
        elif kind == "named":
            named = f"chat-{seed}"
        elif kind == "title":
            named = f"chat-{seed}"
            messages = [{"role": "user", "content": f"a title for chat {seed}, please {amount}"}]
        out.append((copy.deepcopy(messages), named, f"answer {seed}-{turns[seed]}"))
        if number % 4 == 3:  # the same request again, parsed afresh
            out.append((copy.deepcopy(messages), named, f"answer {seed}-{turns[seed]}"))
    return out


@settings(max_examples=60, deadline=None)
@given(_steps)
async def test_resumed_inference_attributes_every_request_as_looking_every_pair_up(
    steps: list[tuple[str, int, int]],
) -> None:
    resumed_store, fresh_store = CountingStore(ttl_s=3600), CountingStore(ttl_s=3600)
    resumed = SessionService(resumed_store, SessionSettings(), Metrics())
    # No conversation kept: every request looks every pair up, as before.
    fresh = SessionService(fresh_store, SessionSettings(), Metrics(), forwarded=Continuations(max_chars=0))
    labels: dict[str, dict[str, int]] = {"resumed": {}, "fresh": {}}

    def label(which: str, session_id: str) -> int:
        return labels[which].setdefault(session_id, len(labels[which]))

    for messages, named, reply in _requests(steps):
        views = []
        for which, sessions in (("resumed", resumed), ("fresh", fresh)):
            view = await sessions.resolve("t", copy.deepcopy(messages), sessions.explicit_id({}, {}) or named)
            views.append((label(which, view.session_id), view.side_lane, view.slid))
            answer = {"role": "assistant", "content": reply}
            await sessions.record(view, Usage(10, 2, 0), answer, messages, 100, None, 60)
        assert views[0] == views[1]

    def held(store: MemorySessionStore, which: str) -> dict[int, int]:
        return {key: label(which, session_id) for key, session_id in store._fingerprints.items()}

    assert held(resumed_store, "resumed") == held(fresh_store, "fresh")
    assert resumed_store.looked_up <= fresh_store.looked_up


async def test_a_long_conversation_looks_up_only_the_pairs_it_adds() -> None:
    store = CountingStore(ttl_s=3600)
    sessions = SessionService(store, SessionSettings(), Metrics())
    found = set()
    for turns in range(1, 40):
        messages = _chat(5, turns)
        view = await sessions.resolve("t", copy.deepcopy(messages))
        found.add(view.session_id)
        before = store.looked_up
        await sessions.record(
            view, Usage(10, 2, 0), {"role": "assistant", "content": f"answer 5-{turns}"}, messages, 1, None, 60
        )
        assert store.looked_up == before
    assert len(found) == 1
    # 39 requests of up to 78 pairs each: each looked up the one or two pairs it added.
    assert store.looked_up < 3 * 39
    # Named, the same: none looked up, and only the new pairs recorded.
    view = await sessions.resolve("t", _chat(6, 2), "named")
    await sessions.record(
        view, Usage(10, 2, 0), {"role": "assistant", "content": "answer 6-2"}, _chat(6, 2), 1, None, 60
    )
    view = await sessions.resolve("t", _chat(6, 3), "named")
    assert view.known_prefix == 5 + 1  # the last request's five pairs and its reply's

"""Which conversation a request names or continues (proxy.sessions.identity), from the outside."""

from __future__ import annotations

from starlette.datastructures import Headers

from proxy.openai.messages import message_fingerprint
from proxy.sessions.identity import conversation_fingerprints, explicit_session_id, reply_fingerprint

NAMES = ("x-session-id", "X-Claude-Code-Session-Id", "session_id")


def named(headers: Headers | dict[str, str], body: dict[str, str] | None = None) -> str | None:
    return explicit_session_id(headers, body or {}, header_names=NAMES, use_prompt_cache_key=True, use_user=False)


def test_session_headers_are_matched_whatever_their_case_and_the_first_sent_counts() -> None:
    raw = [(b"x-claude-code-session-id", b"first"), (b"x-claude-code-session-id", b"second")]
    assert named(Headers(raw=raw)) == named({"x-claude-code-session-id": "first"})
    assert named({"X-SESSION-ID": "abc"}) == named({"x-session-id": "abc"}) is not None
    assert named({"x-claude-code-session-id": "other"}) != named({"x-claude-code-session-id": "first"})


def test_header_names_keep_their_order_and_empty_values_do_not_count() -> None:
    both = {"session_id": "later", "x-session-id": "earlier"}
    assert named(both) == named({"x-session-id": "earlier"})
    assert named({"x-session-id": "", "session_id": "b"}) == named({"session_id": "b"})
    assert named({}, {"prompt_cache_key": "k"}) == named({"x-session-id": "k"})
    assert named({"x-session-id": "   "}) is None


def test_the_reply_pair_is_the_same_from_a_fingerprint_already_taken() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Where is my order?"},
    ]
    reply = {"role": "assistant", "content": "On its way."}
    pairs, last, _ = conversation_fingerprints(messages)
    assert len(pairs) == 3 and last == (messages[-1], message_fingerprint(messages[-1]))
    assert reply_fingerprint(messages, reply, last) == reply_fingerprint(messages, reply)
    # A known fingerprint of another message is not taken for the last one.
    stale = ({"role": "user", "content": "Where is my order?"}, 12345)
    assert reply_fingerprint(messages, reply, stale) == reply_fingerprint(messages, reply)

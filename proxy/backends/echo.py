"""Headers a router sets on its answer for the client to send back (llm-d's ``x-session-token``).

llm-d's session-affinity scorer names the pod that served a request in a response header and routes
the next request that carries it to the same pod. Clients behind the proxy never see upstream
headers (and several proxy replicas serve one conversation), so the proxy plays the client: it
keeps the latest value of each configured header per routing key in the session store (shared by
every replica, expiring with sessions) and sends it with the conversation's next request. The
store down: nothing is echoed and the router picks as it would for a new conversation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from proxy.backends.keyheaders import key_digest
from proxy.config import router_header

Load = Callable[[str], Awaitable[dict[str, str] | None]]
Save = Callable[[str, dict[str, str]], None]


class EchoedHeaders:
    def __init__(self, names: Sequence[str], load: Load, save: Save) -> None:
        try:
            self.names = tuple(dict.fromkeys(router_header(name) for name in names))
        except ValueError as error:
            raise ValueError(f"routing.echo_headers: {error}") from None
        self._load = load
        self._save = save

    async def add_to(self, headers: Mapping[str, str] | None, key: str | None) -> Mapping[str, str] | None:
        """``headers`` plus what the router last set for this key (nothing when unknown)."""
        if key is None:
            return headers
        known = await self._load(key_digest(key))
        if not known:
            return headers
        echoed = {name: value for name, value in known.items() if name in self.names and value.isascii()}
        return {**(headers or {}), **echoed}

    def observe(self, key: str | None, sent: Mapping[str, str] | None, answer: Mapping[str, str]) -> None:
        """Remember the router's values from its answer, when they differ from what was sent."""
        if key is None:
            return
        found = {name: answer[name] for name in self.names if name in answer}
        if found and any((sent or {}).get(name) != value for name, value in found.items()):
            self._save(key_digest(key), found)

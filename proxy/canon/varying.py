"""Which places of an app's system prompt have been seen to carry different text.

A detector (or a user rule) finds spans that *look* request-unique: a date, a
``<context>`` block, an id. Moving one costs every later turn of the conversation the
tokens between its old and its new position, so a span moves only once its place has
been seen with two different values: a Dify context wrapper that is empty on every
request, or a date that stays the same all day, stays where the client put it.

A place is (app, system message, text part, detector kind, ordinal of the span of that
kind): a template's n-th date is the same place whatever text surrounds it. Once a place
has varied it stays volatile (until its app is forgotten, least recently used first):
a value that changes daily must not flip between moved and not moved, or every
conversation in flight would lose its prefix at each flip. Only 64-bit hashes are kept.
"""

from __future__ import annotations

import xxhash
from cachetools import LRUCache

# Marks a place seen with two different values (a hash of a value is never negative).
_VARIED = -1

Place = tuple[int, int, str, int]  # (system message, text part, detector kind, ordinal)


class VaryingPlaces:
    def __init__(self, max_apps: int = 4096, max_places_per_app: int = 256) -> None:
        self._apps: LRUCache[str, dict[Place, int]] = LRUCache(max_apps)
        self._max_places = max_places_per_app

    def observe(self, app_key: str, place: Place, value: str) -> bool:
        """Record ``value`` at ``place``; True when the place has ever held another value."""
        return self.observe_digest(app_key, place, xxhash.xxh3_64_intdigest(value.encode("utf-8", "surrogatepass")))

    def observe_digest(self, app_key: str, place: Place, digest: int) -> bool:
        """:meth:`observe` on the value's hash: what another replica shares."""
        places = self._apps.get(app_key)
        if places is None:
            places = self._apps[app_key] = {}
        known = places.get(place)
        if known is None:
            if len(places) < self._max_places:
                places[place] = digest
            return False
        if known != _VARIED and known != digest:
            places[place] = known = _VARIED
        return known == _VARIED

    def __len__(self) -> int:
        return len(self._apps)

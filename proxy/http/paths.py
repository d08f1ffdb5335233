"""One spelling per route: the request path made canonical before any routing decision.

A route the proxy owns (the pipeline, its admin routes, stored responses) must not be reachable
by another spelling that the catch-all pass-through would forward: ``//v1/chat/completions``,
``/v1//chat/completions/`` and ``/v1/x/../chat/completions`` all name the chat pipeline to an
upstream that merges slashes or resolves dot segments, so they must reach the pipeline here too.
The server decodes the path once (``%63hat`` is ``chat``); a separator the client encoded (``%2F``,
``%5C``), and what is still percent-encoded after that decoding (a separator, a dot or a percent
that a server decoding twice would read as one), is refused rather than guessed at.

One path: what is left must read as one path to every router on the way. The decoded path may hold
only RFC 3986 path characters (ASCII letters, digits, ``-._~!$&'()*+,=:@`` and ``/``): a control
character, whitespace, ``;`` (a path parameter to some servers), ``?``/``#`` (a query or fragment to
one that decodes first), ``%`` (a second decoding), or any non-ASCII character (look-alike slashes, a
server that folds Unicode) is refused with 400 before any routing decision. The case that made it a
rule: Starlette's route patterns end in ``$``, which in Python also matches before a final newline, so
vLLM serves ``/sleep\n`` (sent as ``/sleep%0A``) as ``/sleep`` while an exact comparison saw another
route. A path of these characters means the same to the proxy's rules and to the engine's router
(``tests/test_path_reading.py`` drives both with generated paths).
"""

from __future__ import annotations

import re
from urllib.parse import quote

from starlette.types import Scope

from proxy.http.errors import UnroutablePath

# RFC 3986 path characters other than unreserved ones, kept as they are when re-encoding.
PATH_SAFE = "/:@!$&'()*+,;="

# The characters a canonical path may hold (RFC 3986 ``pchar`` and ``/``, without ``;`` and ``%``).
_PATH_CHARACTERS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@/]*")


class InvalidPath(ValueError):
    """A path that names no route in any spelling: dot segments above the root, separators encoded
    twice, or a character outside a path's own (which some router on the way reads as another path)."""


def invalid_path() -> UnroutablePath:
    """The client's answer to an :class:`InvalidPath`."""
    return UnroutablePath()


def canonical_path(path: str) -> str:
    """``path`` with repeated and trailing slashes dropped and dot segments resolved (RFC 3986
    section 5.2.4): ``//v1/./a//b/`` is ``/v1/a/b``. Raises :class:`InvalidPath`."""
    if _PATH_CHARACTERS.fullmatch(path) is None:
        raise InvalidPath("the path has a character outside a path's own (a control character, space, ';', '%', ...)")
    if "//" not in path and "/." not in path and (len(path) < 2 or path[-1] != "/") and path[:1] == "/":
        return path  # the common case: already canonical
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if not segments:
                raise InvalidPath("the path climbs above the root")
            segments.pop()
        else:
            segments.append(segment)
    return "/" + "/".join(segments)


_RAW_ENCODED_SEPARATOR = re.compile(rb"%(?:2[fF]|5[cC])")


def canonicalize_scope(scope: Scope) -> None:
    """Make an HTTP scope's ``path`` (and ``raw_path``) canonical in place; raises :class:`InvalidPath`.

    A separator the client percent-encoded (``..%2Fmodels``) was meant to be part of a segment, and
    the server has already decoded it into a real one: which route was meant cannot be told, so it
    is refused rather than resolved."""
    raw = scope.get("raw_path")
    if raw and b"%" in raw and _RAW_ENCODED_SEPARATOR.search(raw):
        raise InvalidPath("the path has an encoded separator")
    path = scope["path"]
    canonical = canonical_path(path)
    if canonical != path:
        scope["path"] = canonical
        # What routing and the forwarded request read is ``path``; ``raw_path`` is kept in step so
        # that nothing downstream can see the other spelling.
        scope["raw_path"] = quote(canonical, safe=PATH_SAFE, errors="surrogateescape").encode("ascii")

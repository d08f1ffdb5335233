"""Load tiktoken encodings without touching the network.

tiktoken downloads its BPE files from a public blob store on first use, which
fails on air-gapped hosts and adds a cold-start delay everywhere else. The
cl100k_base ranks ship inside this package instead and are verified against the
same SHA-256 that tiktoken itself pins, so the encoding is bit-identical.
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from importlib import resources

import tiktoken

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""  # noqa: E501
CL100K_SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}


class EncodingIntegrityError(RuntimeError):
    """The bundled BPE file does not match the hash tiktoken pins."""


def _parse_ranks(blob: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in blob.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=4)
def load_encoding(
    name: str = "cl100k_base", extra_special_tokens: tuple[tuple[str, int], ...] = ()
) -> tiktoken.Encoding:
    """Return a tiktoken Encoding built from the bundled file (never downloads).

    ``extra_special_tokens`` adds control tokens (chat-template markers such as
    ``<|im_start|>``) on top of the encoding's own.
    """
    if name != "cl100k_base":
        raise ValueError(f"only cl100k_base is bundled, not {name!r}")
    blob = resources.files("proxy.tokenization").joinpath("data/cl100k_base.tiktoken").read_bytes()
    if hashlib.sha256(blob).hexdigest() != CL100K_SHA256:
        raise EncodingIntegrityError("bundled cl100k_base.tiktoken is corrupt")
    return tiktoken.Encoding(
        name=name if not extra_special_tokens else f"{name}+chat",
        pat_str=CL100K_PATTERN,
        mergeable_ranks=_parse_ranks(blob),
        special_tokens={**CL100K_SPECIAL_TOKENS, **dict(extra_special_tokens)},
    )

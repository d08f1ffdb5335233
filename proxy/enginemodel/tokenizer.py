"""Tokenizers for the engine model: what turns a rendered prompt into the ids vLLM hashes.

Two implementations behind one small protocol:

* ``TiktokenChatTokenizer`` (default): cl100k_base from the bundled BPE file (never downloads)
  with the ChatML markers as single special tokens, the way a ChatML model's tokenizer treats
  them. Special-token text inside the prompt is always parsed as the special token, as Hugging
  Face tokenizers (and therefore vLLM) do for added tokens.
* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, for
  exact ids of a real model. Chat prompts are encoded with ``add_special_tokens=False`` like
  vLLM does (the template already carries BOS-like markers); raw completions prompts with
  ``True``, vLLM's default for ``/v1/completions`` and ``/tokenize`` with a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from proxy.tokenization import load_encoding

# The ids OpenAI's ChatML encodings give these markers; nothing in cl100k_base uses them.
CHATML_SPECIAL_TOKENS: tuple[tuple[str, int], ...] = (("<|im_start|>", 100264), ("<|im_end|>", 100265))
DEFAULT_EOS_TOKEN = "<|im_end|>"


@runtime_checkable
class ChatTokenizer(Protocol):
    """What the engine model needs from a tokenizer."""

    name: str
    eos_token_id: int

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TiktokenChatTokenizer:
    """cl100k_base plus ChatML markers; the default when no tokenizer file is given."""

    name = "cl100k_base+chatml"

    def __init__(self) -> None:
        self._encoding = load_encoding(extra_special_tokens=CHATML_SPECIAL_TOKENS)
        self.eos_token_id = dict(CHATML_SPECIAL_TOKENS)[DEFAULT_EOS_TOKEN]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # cl100k has no BOS/EOS post-processing, so add_special_tokens has nothing to add.
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (file, or a directory containing one)."""

    def __init__(self, path: str | Path, eos_token: str = DEFAULT_EOS_TOKEN) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        self._tokenizer = Tokenizer.from_file(str(file))
        self.name = str(file)
        eos_id = self._tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"{file} has no {eos_token!r} token to end replies with")
        self.eos_token_id = eos_id

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        # Keep special tokens so a decoded prompt shows its template markers.
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text


def load_tokenizer(path: str | Path | None = None, eos_token: str = DEFAULT_EOS_TOKEN) -> ChatTokenizer:
    """The tokenizer of a ``tokenizer.json`` (file or directory; ``None``: bundled cl100k)."""
    if path is None:
        return TiktokenChatTokenizer()
    return HFTokenizer(path, eos_token=eos_token)
